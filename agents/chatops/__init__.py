"""Chat-ops: operators ask the cluster about its state in plain words (`pdd ask`, POST /pdd/chat).

A LangGraph tool-calling agent over any OpenAI-compatible endpoint, or, with
no model configured, rules over the same tools. It reads (Prometheus,
/pdd/state, journeys, the agents' audit trail, diagnosis and runbooks) and
answers with the figures it used; it never changes anything. A change the
operator asks for is filed as a proposal in the agents' approval flow.

intent (is this message a change request; is a proposal grounded in it),
templates (named PromQL), sources (state and journeys: HTTP or in-process),
records (runbooks, action entries, tick history), evidence (figures, fenced
tool data), tools (the read-only toolbox), propose (filing into the approval
flow), prompts, graph (the LangGraph graph), agent (streamed events over a
conversation checkpointer), questions, answers and rules (the answerer without
an LLM), cli (`pdd ask`), endpoint (POST /pdd/chat).
"""
