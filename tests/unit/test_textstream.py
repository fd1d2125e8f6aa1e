import pytest
from transformers import AutoTokenizer

from app.conductor.textstream import TextAssembler
from app.engine.devmodel import ensure_devmodel


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(ensure_devmodel()))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _run(tok, ids, stop=None, chunk=1):
    asm = TextAssembler(tok.backend_tokenizer, _ids(tok, "the prompt"), stop)
    out = ""
    for i in range(0, len(ids), chunk):
        d = asm.feed(ids[i : i + chunk])
        out += d.text
        if d.stopped:
            return out, True, asm
    return out + asm.finish(), False, asm


def test_incremental_text_equals_full_decode(tok):
    ids = _ids(tok, "hello world, the model serves requests across two datacenters")
    out, stopped, _ = _run(tok, ids)
    assert not stopped
    assert out.strip() == tok.decode(ids, skip_special_tokens=True).strip()


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_truncates_and_is_excluded(tok, chunk):
    ids = _ids(tok, "hello world, the model serves requests across two datacenters")
    out, stopped, asm = _run(tok, ids, stop=["serves req"], chunk=chunk)
    assert stopped
    assert out.rstrip().endswith("model")
    assert "serves" not in out
    assert asm.num_tokens < len(ids)


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    asm = TextAssembler(tok.backend_tokenizer, [], ["world peace"])
    sent = asm.feed(_ids(tok, "hello world"))
    assert "world" not in sent.text  # could still become "world peace"
    sent2 = asm.feed(_ids(tok, " order"))
    assert "world" in sent.text + sent2.text
    assert not sent2.stopped


def test_stop_spanning_two_feeds(tok):
    asm = TextAssembler(tok.backend_tokenizer, [], ["two datacenters"])
    first = asm.feed(_ids(tok, "across two"))
    second = asm.feed(_ids(tok, " datacenters and more"))
    assert second.stopped
    assert (first.text + second.text).strip() == "across"


def test_earliest_of_several_stops_wins(tok):
    out, stopped, _ = _run(tok, _ids(tok, "one two three four five"), stop=["four", "two"])
    assert stopped and out.strip() == "one"


def test_feeding_after_stop_yields_nothing(tok):
    asm = TextAssembler(tok.backend_tokenizer, [], ["two"])
    assert asm.feed(_ids(tok, "one two three")).stopped
    late = asm.feed(_ids(tok, "four"))
    assert late.stopped and late.text == ""


def _assemble(tok, ids, **kw):
    asm = TextAssembler(tok.backend_tokenizer, _ids(tok, "the prompt"), **kw)
    out = ""
    for tid in ids:
        d = asm.feed([tid])
        out += d.text
        if d.stopped:
            return out, d.num_tokens, asm.num_tokens
    return out + asm.finish(), None, asm.num_tokens


def test_no_stop_string_ends_the_output_within_min_tokens(tok):
    ids = _ids(tok, "stop here, then stop again and more")
    early, _, first_end = _assemble(tok, ids, stop=["stop"])
    assert early.strip() == ""
    later, _, second_end = _assemble(tok, ids, stop=["stop"], min_tokens=first_end)
    assert later.strip() == "stop here, then" and second_end > first_end


def test_the_stop_string_and_the_stop_tokens_text_are_kept_only_when_asked(tok):
    ids = _ids(tok, "one two three four")
    assert _assemble(tok, ids, stop=["three"])[0].strip() == "one two"
    assert _assemble(tok, ids, stop=["three"], include_stop=True)[0].strip() == "one two three"
    stop_id = _ids(tok, "one two three")[-1]
    text, at, _ = _assemble(tok, ids, stop_token_ids=[stop_id])
    assert text.strip() == "one two" and at == 1  # the stop token counts as output, its text does not
    assert _assemble(tok, ids, stop_token_ids=[stop_id], include_stop=True)[0].strip() == "one two three"
