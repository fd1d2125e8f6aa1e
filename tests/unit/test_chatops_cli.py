"""`pdd ask` and the POST /pdd/chat glue, without a cluster or an LLM endpoint."""

from __future__ import annotations

import pytest
import yaml
from langchain_core.messages import AIMessage, HumanMessage
from pydantic import ValidationError
from typer.testing import CliRunner

from agents.chatops import agent as chat_agent
from agents.chatops.endpoint import ChatOpsRequest
from app.ops.cli import main
from tests.integration.agents_fixtures import pdd_args
from tests.unit.test_chatops_agent import FakeToolCallingChatModel, call, scripted


def test_ask_streams_lists_figures_and_remembers_the_thread(tmp_path, monkeypatch):
    args = pdd_args(
        chat_db=str(tmp_path / "chat.sqlite"),
        audit_db=str(tmp_path / "audit.sqlite"),
        actions_dir=str(tmp_path / "actions"),
        prometheus_url="http://127.0.0.1:9",
        llm={"base_url": "http://127.0.0.1:9/v1", "model": "m"},
    )
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"applications": [{"name": "pdd", "import_path": "app.builder:build_app", "args": args}]}))
    llm = FakeToolCallingChatModel(
        policy=scripted(
            AIMessage("", tool_calls=[call("read_runbook", {"situation": "wan_degradation"})]),
            AIMessage("The WAN runbook says: check the link model."),
            lambda msgs: AIMessage(f"This thread has {sum(isinstance(m, HumanMessage) for m in msgs)} questions."),
        )
    )
    monkeypatch.setattr(chat_agent, "llm_for", lambda agents: llm)
    runner = CliRunner()
    out = runner.invoke(main, ["ask", "what does the WAN runbook say?", "--config", str(cfg), "--url", "http://127.0.0.1:9"])
    assert out.exit_code == 0, out.output
    assert "The WAN runbook says: check the link model." in out.output
    assert "figures used" in out.output and "runbooks/wan_degradation.md" in out.output
    thread = out.output.split("--thread ")[1].split(")")[0]
    again = runner.invoke(main, ["ask", "how many questions so far?", "--config", str(cfg), "--thread", thread])
    assert again.exit_code == 0 and "This thread has 2 questions." in again.output
    assert (tmp_path / "chat.sqlite").exists()


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"message": ""},
        {"message": "hi", "thread_id": "../../etc"},
        {"message": "hi", "model": "x"},
        {"message": "x" * 8001},
    ],
)
def test_chat_request_body_is_checked(body):
    with pytest.raises(ValidationError):
        ChatOpsRequest.model_validate(body)
