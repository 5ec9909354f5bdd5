"""Several policies in one run: a writer and a checker, each its own LoRA adapter on one tiny base model.

The agent is a LangGraph graph with two nodes, ``writer`` and ``checker``, each one ``ChatOpenAI`` call
with the same prompt; agl's LangChain plugin makes each node an agent scope, and the instrumented
openai client tells the gateway which (``X-Agl-Agent``). The roles need opposite answers to the same
input: the writer is rewarded for ``A``, the checker for ``B`` (0.5 each, the run's final reward). One
shared policy answers both from one distribution, so whatever it learns it scores 0.5 on average;
two adapters learn each its own answer.

Everything runs for real: the worker, the server, the gateway, the torch engine serving the peft
model with both adapters, and the trainer stepping each adapter with its own optimizer.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import httpx
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")

from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402

import agl_core as agl  # noqa: E402
from agl_core import semconv  # noqa: E402
from agl_core.cli.traces import render_rollout  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_core.transitions import TransitionBuilder  # noqa: E402
from agl_core.worker import Worker, point_openai_at  # noqa: E402
from agl_trainer.demo.policy import PolicySpec, build_model, build_tokenizer  # noqa: E402
from agl_trainer.gateway import GatewayConfig, OpenAIBackend, training_sampling  # noqa: E402
from agl_trainer.policies import MultiPolicyBackend, Policy, PolicyRouter  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402
from agl_trainer.torch_backend import LoraOptions, TorchBackend, TorchConfig  # noqa: E402
from agl_trainer.training import TrainConfig, Trainer  # noqa: E402

torch.set_num_threads(1)

ROLES = {"writer": "A", "checker": "B"}
"""Each role's rewarded answer to the very same prompt."""
PROMPT = [{"role": "user", "content": "say one"}]
LORA = LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"])
POLICIES = [Policy("writer", "^writer$", LORA), Policy("checker", "^checker$", LORA)]
OWN_CREDIT = [Policy(p.name, p.agents, p.lora, credit="discounted", gamma=0.0) for p in POLICIES]
"""Each policy credited its own calls' rewards alone (the run's default: every call the run's return)."""


class State(TypedDict, total=False):
    roles: list[str]
    said: dict[str, str]
    noisy: bool


def _node(role: str) -> Any:
    def node(state: State) -> State:
        model = ChatOpenAI(model="policy", max_retries=0, max_tokens=1, temperature=1.0)
        said = str(model.invoke(PROMPT).content).strip()
        if state.get("noisy"):  # a reward whatever was said: every group has spread, so a step always has signal
            agl.emit_reward(random.random(), name=role)
        else:
            agl.emit_reward(0.5 if said == ROLES[role] else 0.0, name=role)  # on this role's own call
        return {"said": {**state.get("said", {}), role: said}}
    return node


def two_roles(task: dict[str, Any]) -> None:
    """The writer, then the checker (or only the roles the task names), on the same prompt; each call rewarded 0.5
    when right, on the call (no final reward: the run's return, its ``final`` credit, is the sum); a ``noisy``
    task rewards each call at random."""
    roles = task.get("roles", list(ROLES))
    graph = StateGraph(State)
    last = START
    for role in roles:
        graph.add_node(role, _node(role))
        graph.add_edge(last, role)
        last = role
    graph.add_edge(last, END)
    graph.compile().invoke({"roles": roles, "said": {}, "noisy": bool(task.get("noisy"))})


@pytest.fixture(autouse=True)
def langchain_instrumented(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # the worker points it at the gateway
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    logging.getLogger("agl.worker").setLevel(logging.ERROR)
    assert "langchain" in agl.instrument(["langchain"])
    yield
    agl.uninstrument(["langchain"])


def _tiny() -> tuple[Any, Any]:
    spec = PolicySpec(["user", "assistant", "say", "one"], [], ["A", "B"])
    tokenizer = build_tokenizer(spec)
    return build_model(tokenizer, spec, seed=0, hidden=32, layers=1), tokenizer


class Run:
    """A server, a worker and a trainer around ``backend``'s engine; stopped by :meth:`close`."""

    def __init__(self, folder: Path, backend: Any, tokenizer: Any, tasks: list[Any], *,
                 router: PolicyRouter | None, group_size: int = 16) -> None:
        self.backend = backend
        self.engine = backend.engine(tokenizer, name="base", seed=0, max_batch=32, batch_wait_s=0.003,
                                     default_max_tokens=1)
        builder = TransitionBuilder(agent_match=router.agent_match() if router is not None else None)
        gateway = GatewayConfig(sampling_overrides=training_sampling(1.0), policies=router)
        self.server = TrainerServer(ServerConfig(db_path=str(folder / "agl.db"), port=0, builder=builder,
                                                 gateway=gateway), self.engine)
        self.thread = ServerThread(self.server).start()
        point_openai_at(self.thread.url, None)
        self.worker = Worker(self.thread.url, two_roles, concurrency=16, poll_s=0.05, grace_s=2.0)
        self.running = threading.Thread(target=self.worker.run, daemon=True)
        self.running.start()
        self.trainer = Trainer(self.server, backend, self.engine, tasks,
                               TrainConfig(tasks_per_step=1, group_size=group_size,
                                           checkpoint_dir=str(folder / "ckpt")))

    def close(self) -> None:
        self.worker.stop(now=True)
        self.running.join(timeout=10)
        self.thread.stop()


def _adapter_weights(backend: MultiPolicyBackend, name: str) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in backend.backends[name]._adapter_parameters()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_adapters_learn_opposite_roles_that_one_shared_policy_cannot(tmp_path: Path) -> None:
    base, tokenizer = _tiny()
    config = TorchConfig(lr=2e-2, epochs=3, minibatches=2, gradient_checkpointing=False)

    # one shared policy (a single LoRA adapter for both roles): the same prompt, one distribution
    shared = TorchBackend(copy.deepcopy(base), TorchConfig(**{**config.__dict__, "lora": LORA}),
                          pad_id=tokenizer.pad_token_id)
    (tmp_path / "shared").mkdir()
    run = Run(tmp_path / "shared", shared, tokenizer, [{"id": 0}], router=None)
    try:
        single = [h.reward for h in run.trainer.run(6)]
    finally:
        run.close()
    # 0.5 on average whatever it learns (p/2 + (1-p)/2); 6 steps x 16 rollouts: 0.62 is over 3 standard errors
    assert sum(single) / len(single) < 0.62, single

    # two policies: each role its own adapter, trained on its own calls' rewards (with the run's return for both,
    # the other role's answer is noise in each one's advantage, and a role can settle on the wrong answer for good)
    multi = MultiPolicyBackend(copy.deepcopy(base), OWN_CREDIT, config, pad_id=tokenizer.pad_token_id)
    (tmp_path / "multi").mkdir()
    run = Run(tmp_path / "multi", multi, tokenizer, [{"id": 0}], router=multi.router)
    try:
        history = run.trainer.run(25, stop=lambda h: len(h) >= 2 and (h[-1].reward + h[-2].reward) / 2 >= 0.9)
        rewards = [round(h.reward, 2) for h in history]
        print(f"one shared policy: {[round(r, 2) for r in single]}; two adapters: {rewards}")
        assert (history[-1].reward + history[-2].reward) / 2 >= 0.9, rewards
        assert history[0].reward < 0.7, rewards
        last = history[-1].metrics
        for name in ROLES:  # each policy stepped on its own, with its own numbers
            assert last[f"policy/{name}/rows"] > 0, last
            assert last[f"policy/{name}/transitions"] == 16, last
            assert f"policy/{name}/loss" in last and f"policy/{name}/ratio_first_mean" in last
            assert last[f"policy/{name}/reward_share"] == pytest.approx(0.5, abs=0.2)
        for step in history:  # every call sampled from its own adapter, calls of both arriving together: ratio 1
            for name in ROLES:
                assert step.metrics[f"policy/{name}/ratio_first_mean"] == pytest.approx(1.0, abs=2e-2), step.metrics
        recorded = run.server.metrics()[-1]["values"]  # what the dashboard and GET /v1/metrics draw
        assert recorded["policy/checker/loss"] == last["policy/checker/loss"]

        # the served calls said which policy answered each
        rollout = run.server.store.rollouts()[-1]
        spans = [s for s in run.server.store.spans(rollout.id) if s.attributes.get(semconv.AGL_POLICY)]
        assert sorted(s.attributes[semconv.AGL_POLICY] for s in spans) == ["checker", "writer"]
        traj = run.server.store.trajectories(rollout_ids=[rollout.id])[0]
        assert sorted(t.model or "" for t in traj.transitions) == ["checker", "writer"]
        for t in traj.transitions:
            assert t.model == t.agent_name  # the model that answered is the agent's policy

        # a step with only the writer's calls moves the writer's adapter, never the checker's (rewarded at random:
        # both have learned their answer, and a group without spread would move no weight at all)
        writer_before, checker_before = _adapter_weights(multi, "writer"), _adapter_weights(multi, "checker")
        run.trainer.tasks = [{"id": 1, "roles": ["writer"], "noisy": True}]
        step = run.trainer.step()
        assert step.metrics["policy/checker/rows"] == 0 and step.metrics["policy/writer/rows"] > 0, step.metrics
        assert _same(_adapter_weights(multi, "checker"), checker_before)
        assert not _same(_adapter_weights(multi, "writer"), writer_before)
        run.trainer.save()
        saved = {name: _adapter_weights(multi, name) for name in ROLES}
        steps = multi.step
    finally:
        run.close()

    # resume: every policy's adapter (and the step) comes back
    again = MultiPolicyBackend(copy.deepcopy(base), OWN_CREDIT, config, pad_id=tokenizer.pad_token_id)
    assert not _same(_adapter_weights(again, "writer"), saved["writer"])
    again.load(tmp_path / "multi" / "ckpt")
    assert again.step == steps
    for name in ROLES:
        assert _same(_adapter_weights(again, name), saved[name])
    with pytest.raises(ValueError, match="holds policies"):
        MultiPolicyBackend(copy.deepcopy(base), POLICIES[:1], config).load(tmp_path / "multi" / "ckpt")


def test_a_policy_with_its_own_credit_is_trained_on_its_calls_rewards_the_others_on_the_runs(tmp_path: Path) -> None:
    base, tokenizer = _tiny()
    policies = [POLICIES[0], OWN_CREDIT[1]]  # the writer the run's return (the default), the checker its own reward
    multi = MultiPolicyBackend(base, policies, TorchConfig(lr=1e-3, gradient_checkpointing=False),
                               pad_id=tokenizer.pad_token_id)
    run = Run(tmp_path, multi, tokenizer, [{"id": 0}], router=multi.router, group_size=12)
    try:
        step = run.trainer.step()
        calls = {traj.rollout_id: {t.agent_name: t.reward or 0.0 for t in traj.transitions}
                 for traj in run.server.store.trajectories()}
    finally:
        run.close()
    assert len(calls) == 12 and all(set(c) == {"writer", "checker"} for c in calls.values())
    writer, checker = multi.last_batches["writer"].scored, multi.last_batches["checker"].scored
    for scored in writer:  # the run's return: its own call's reward and the checker's after it
        assert scored.credited == [pytest.approx(sum(calls[scored.trajectory.rollout_id].values()))]
    for scored in checker:  # its own call's reward alone
        assert scored.credited == [pytest.approx(calls[scored.trajectory.rollout_id]["checker"])]
    said_b = [s.advantages[0] for s in checker if calls[s.trajectory.rollout_id]["checker"] > 0]
    said_a = [s.advantages[0] for s in checker if calls[s.trajectory.rollout_id]["checker"] == 0]
    if said_a and said_b:  # a checker that said B is pushed up, whatever the writer said
        assert min(said_b) > 0 > max(said_a), (said_b, said_a)
    # the step counts what the policies trained: each call once, in its own policy's rows
    assert step.transitions == 24 and step.metrics["transitions_trained"] <= 24
    assert step.rows == step.metrics["policy/writer/rows"] + step.metrics["policy/checker/rows"]


def test_a_step_whose_policies_had_nothing_to_learn_says_so_though_the_runs_credit_had_spread(tmp_path: Path) -> None:
    def nothing(rewards: Any, final: Any) -> list[float]:
        return [0.0] * len(rewards)

    base, tokenizer = _tiny()
    flat = [Policy(p.name, p.agents, p.lora, credit=nothing) for p in POLICIES]
    multi = MultiPolicyBackend(base, flat, TorchConfig(gradient_checkpointing=False), pad_id=tokenizer.pad_token_id)
    run = Run(tmp_path, multi, tokenizer, [{"id": 0}], router=multi.router, group_size=12)
    try:
        step = run.trainer.step()
        returns = {sum(t.reward or 0.0 for t in traj.transitions) for traj in run.server.store.trajectories()}
    finally:
        run.close()
    assert len(returns) > 1  # the run's own credit had something to learn from
    # the step's signal is the policies' (each group flat: nothing to learn), not the run's credit's (spread)
    assert step.metrics["flat_groups"] == step.metrics["groups"] == 2, step.metrics
    assert step.metrics["advantage_max_abs"] == 0.0 and step.metrics["warn_flat_groups"] == 1.0
    assert any("2 of 2 groups" in line for line in step.warnings), step.warnings


# ---------------------------------------------------------------------- routing


def _scoped(role: str, *, stream: bool = False) -> Any:
    """One call from inside LangGraph node ``role`` (an agent scope), streamed or not; the reply's model."""
    def node(state: State) -> State:
        model = ChatOpenAI(model="policy", max_retries=0, max_tokens=1, streaming=stream)
        said = model.invoke(PROMPT)
        return {"said": {role: str(said.response_metadata.get("model_name"))}}
    graph = StateGraph(State)
    graph.add_node(role, node)
    graph.add_edge(START, role)
    graph.add_edge(role, END)
    return graph.compile().invoke({"said": {}})["said"][role]


def _rollout(server_url: str, role: str, *, stream: bool = False) -> tuple[str, list[Any]]:
    point_openai_at(server_url, None)
    with agl.rollout(task_id=f"t-{role}", store=agl.HttpStore(server_url)) as run:
        model = _scoped(role, stream=stream)
    return model, run.rollout.id


def _recorded_logprob(store: Any, rollout_id: str) -> tuple[float, list[int], list[int], dict[str, Any]]:
    span = next(s for s in store.spans(rollout_id) if s.attributes.get(semconv.AGL_RESPONSE_TOKEN_IDS)
                and s.attributes.get(semconv.AGL_PLUGIN) == "openai")
    a = span.attributes
    return a[semconv.AGL_RESPONSE_LOGPROBS][0], a[semconv.AGL_PROMPT_TOKEN_IDS], a[semconv.AGL_RESPONSE_TOKEN_IDS], a


def _logprob(model: Any, prompt: list[int], token: int, adapter: str | None) -> float:
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1)[token])


@pytest.mark.parametrize("stream", [False, True])
def test_each_agent_is_answered_by_its_own_adapter_and_an_unknown_one_by_the_base(
        make_server: Any, stream: bool) -> None:
    base, tokenizer = _tiny()
    policies = [Policy("writer", "writ", LORA), Policy("checker", "check", LORA)]
    multi = MultiPolicyBackend(base, policies, TorchConfig(gradient_checkpointing=False),
                               pad_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    with torch.no_grad():  # adapters that answer differently: each its own distribution
        for name, p in multi.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    engine = multi.engine(tokenizer, name="base", seed=0, default_max_tokens=1)
    server = make_server(engine, gateway=GatewayConfig(policies=multi.router))
    for role, policy in (("writer", "writer"), ("rewriter", "writer"), ("checker", "checker"), ("judge", None)):
        served, rollout_id = _rollout(server.url, role, stream=stream)
        assert served == (policy or "base"), role
        logprob, prompt, response, attrs = _recorded_logprob(server.server.store, rollout_id)
        assert attrs.get(semconv.AGL_POLICY) == policy
        expected = {a: _logprob(multi.model, prompt, response[0], a) for a in ("writer", "checker", None)}
        assert logprob == pytest.approx(expected[policy], abs=1e-4), (role, logprob, expected)
        others = [v for a, v in expected.items() if a != policy]
        assert all(abs(v - logprob) > 1e-3 for v in others), (role, expected)  # the adapters do differ
        if policy is None:  # the base answered, and the span says why
            assert "'judge' matches no policy" in attrs[semconv.AGL_POLICY_NOTE]
        traj = server.server.store.trajectories(rollout_ids=[rollout_id])[0]
        assert [t.model for t in traj.transitions] == [policy or "base"]
        shown = render_rollout(server.server.store.get_rollout(rollout_id, with_spans=True), traj.transitions,
                               width=400)
        assert (f"policy {policy}" if policy else "base model: agent 'judge' matches no policy") in shown, shown


def test_calls_of_alternating_adapters_are_batched_by_adapter_not_one_a_batch(make_server: Any) -> None:
    base, tokenizer = _tiny()
    multi = MultiPolicyBackend(base, POLICIES, TorchConfig(gradient_checkpointing=False),
                               pad_id=tokenizer.pad_token_id)
    # a window far longer than the calls take to arrive, closed by the fourth call of its adapter (max_batch),
    # so the figures do not depend on how fast a loaded machine starts threads
    engine = multi.engine(tokenizer, name="base", seed=0, default_max_tokens=1, max_batch=4, batch_wait_s=30)
    server = make_server(engine, gateway=GatewayConfig(policies=multi.router))
    answered: dict[int, str] = {}

    def call(i: int) -> None:  # writer, checker, writer, ... arriving interleaved within one batch window
        body = {"model": "policy", "messages": PROMPT, "max_tokens": 1}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                           headers={"X-Agl-Agent": ("writer", "checker")[i % 2]})
        answered[i] = reply.json()["model"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert answered == {i: ("writer", "checker")[i % 2] for i in range(8)}
    # one batch per adapter (the second adapter's calls waited for theirs), never eight batches of one
    assert sorted(engine.batches) == [4, 4], engine.batches


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_serves_each_agent_by_its_policys_lora_name(make_server: Any, tmp_path: Path, stream: bool) -> None:
    base, tokenizer = _tiny()
    multi = MultiPolicyBackend(base, POLICIES, TorchConfig(gradient_checkpointing=False))
    with FakeOpenAI(enable_lora=True, return_token_ids=True) as vllm:  # a call for an adapter not loaded is a 404
        from agl_trainer.vllm_lora import VllmAdapters, VllmPoliciesLink

        server = make_server(OpenAIBackend(vllm.url), gateway=GatewayConfig(policies=multi.router))
        link = VllmPoliciesLink(server.server, {n: VllmAdapters(vllm.url, n) for n in multi.names},
                                str(tmp_path / "adapters"))
        version = link.publish(multi)
        assert sorted(vllm.adapters) == ["checker", "writer"]
        assert all(f"/v{version}" in folder for folder in vllm.adapters.values())
        for role in ("writer", "checker", "judge"):
            served, rollout_id = _rollout(server.url, role, stream=stream)
            asked = [r.body["model"] for r in vllm.requests if r.path.endswith("/chat/completions")][-1]
            assert asked == (role if role != "judge" else vllm.model), role
            assert served == asked
            assert vllm.requests[-1].body.get("stream", False) is stream


# ---------------------------------------------------------------------- config


def _raw(**changes: Any) -> dict[str, Any]:
    return {"data": {"path": "tasks.jsonl"}, "agent": "pkg.mod:agent", "backend": {"model": "m"}, **changes}


def test_the_policies_section_is_checked_and_names_the_fix() -> None:
    from agl_trainer.config import ConfigError, transition_builder, validate
    from agl_trainer.policies import policies_of

    config = validate(_raw(policies={"writer": {"agents": "writ", "lora": {"r": 16}}, "checker": {"agents": "check"}},
                           backend={"model": "m", "lora": {"r": 2, "alpha": 4}}))
    policies = policies_of(config)
    assert [(p.name, p.agents, p.lora.r) for p in policies] == [("writer", "writ", 16), ("checker", "check", 2)]
    assert [(p.credit, p.gamma) for p in policies] == [(None, 1.0), (None, 1.0)]  # the run's credit
    builder = transition_builder(config)
    assert builder.settings()["agent_match"] == "(?:writ)|(?:check)"
    own = validate(_raw(policies={"w": {"agents": "w", "credit": {"method": "discounted", "gamma": 0}},
                                  "c": {"agents": "c", "credit": {"method": "custom",
                                                                  "function": "agl_core.credit:assign"}}}))
    w, c = policies_of(own)
    assert (w.credit, w.gamma) == ("discounted", 0.0)
    from agl_core.credit import assign
    assert c.credit is assign
    with pytest.raises(ConfigError, match=r"^config error: policies\.w\.credit\.function: required with "
                                          r"policies\.w\.credit\.method: custom"):
        validate(_raw(policies={"w": {"agents": "w", "credit": {"method": "custom"}}}))
    with pytest.raises(ConfigError, match=r"policies\.w\.credit\.gamma"):
        validate(_raw(policies={"w": {"agents": "w", "credit": {"method": "discounted", "gamma": 2}}}))
    with pytest.raises(ConfigError, match=r"^config error: policies: and agent_match \('writer'\) both select the "
                                          r"trained agents: .*drop agent_match"):
        validate(_raw(policies={"w": {"agents": "w"}}, agent_match="writer"))
    with pytest.raises(ConfigError, match=r"^config error: policies\.w\.agents: '\(' is not a valid regular "
                                          r"expression"):
        validate(_raw(policies={"w": {"agents": "("}}))
    with pytest.raises(ConfigError, match=r"^config error: policies\.a b: a policy's name"):
        validate(_raw(policies={"a b": {"agents": "x"}}))
    with pytest.raises(ConfigError, match=r"^config error: policies\.writer\.v2: .*peft refuses '\.'"):
        validate(_raw(policies={"writer.v2": {"agents": "x"}}))  # passed --check, then peft raised building the model
    with pytest.raises(ConfigError, match=r"^config error: policies: are trained by the torch backend"):
        validate(_raw(policies={"w": {"agents": "w"}}, backend={"model": "m", "name": "verl"}))
    with pytest.raises(ConfigError, match=r"^config error: policies: train model weights.*algorithm\.name apo"):
        validate(_raw(policies={"w": {"agents": "w"}}, algorithm={"name": "apo"}))
    with pytest.raises(ConfigError, match=r"policies\.w\.agent: unknown key \(did you mean agents\?\); allowed: "
                                          r"agents, lora"):
        validate(_raw(policies={"w": {"agent": "w"}}))


ROLES_AGENT = '''
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from typing import TypedDict


class State(TypedDict, total=False):
    said: dict


def node(role):
    def run(state):
        reply = ChatOpenAI(model="policy", max_retries=0, max_tokens=1).invoke([{"role": "user", "content": "say one"}])
        return {"said": {**state.get("said", {}), role: str(reply.content).strip()}}
    return run


def solve(task):
    graph = StateGraph(State)
    graph.add_node("writer", node("writer"))
    graph.add_node("checker", node("checker"))
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_edge("checker", END)
    said = graph.compile().invoke({"said": {}})["said"]
    return 0.5 * (said.get("writer") == "A") + 0.5 * (said.get("checker") == "B")


def nothing(rewards, final):
    return [0.0] * len(rewards)
'''


def test_agl_train_runs_several_policies_from_a_config_and_resumes_them(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_trainer.config import validate
    from agl_trainer.train_cli import run_training, step_line

    model, tokenizer = _tiny()
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    (tmp_path / "roles_agent.py").write_text(ROLES_AGENT, encoding="utf-8")
    (tmp_path / "tasks.jsonl").write_text('{"id": 0}\n', encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = {"data": {"path": "tasks.jsonl", "group_size": 4, "tasks_per_step": 1}, "agent": "roles_agent:solve",
           "backend": {"model": "policy", "threads": 1, "gradient_checkpointing": False,
                       "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}},
           "algorithm": {"lr": 1e-2},
           "policies": {"writer": {"agents": "^writer$"}, "checker": {"agents": "^checker$", "lora": {"r": 4},
                                                                     "credit": {"method": "custom",
                                                                                "function": "roles_agent:nothing"}}},
           "workers": {"count": 4}, "run": {"steps": 2, "dir": "out", "checkpoint_every": 1}}
    outcome = run_training(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert len(outcome.steps) == 2 and not outcome.resumed
    for step in outcome.steps:
        for name in ("writer", "checker"):
            assert step["metrics"][f"policy/{name}/transitions"] == 4, step["metrics"]
        # the writer credited the run's way (its return), the checker its own (the config's function: nothing)
        assert step["metrics"]["policy/writer/reward"] == pytest.approx(step["reward"]), step
        assert step["metrics"]["policy/checker/reward"] == 0.0 and step["metrics"]["flat_groups"] >= 1
    assert (tmp_path / "out" / "checkpoint" / "policies.json").exists()
    ranks = {}
    for name in ("writer", "checker"):
        state = torch.load(tmp_path / "out" / "checkpoint" / "policies" / name / "trainer.pt", weights_only=True)
        ranks[name] = {tuple(v.shape) for k, v in state["model"].items() if "lora_A" in k}
        assert state["model"] and all(f".{name}." in k for k in state["model"])  # each checkpoint its own adapter
    assert ranks == {"writer": {(2, 32)}, "checker": {(4, 32)}}  # backend.lora, or the policy's own
    from agl_trainer.training import StepResult

    line = step_line(StepResult.from_dict(outcome.steps[-1]), 2, 1.0)
    assert "| writer: reward" in line and "| checker: reward" in line

    raw["run"]["steps"] = 3
    again = run_training(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert again.resumed and [s["step"] for s in again.steps] == [1, 2, 3]


def test_a_token_record_keeps_its_policy_through_the_file() -> None:
    from agl_trainer.token_records import TokenRecord

    record = TokenRecord([1], [2], [-0.5], "base", 3, 1.0, None, None, "agent 'judge' matches no policy")
    assert TokenRecord.from_json(record.to_json()) == record
    plain = TokenRecord([1], [2], None, "m", 0, 1.0)
    assert TokenRecord.from_json(plain.to_json()) == plain and len(json.loads(plain.to_json())) == 6


def test_agl_demo_multi_policy_trains_both_roles_and_draws_a_curve_per_policy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.demo.run import main

    assert main(["--multi-policy", "--dir", str(tmp_path / "demo"), "--quiet", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "Target 0.9 for both over the last 2 steps: reached." in out
    rows = [line.split("|")[1:4] for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert float(rows[0][1]) < 0.9 or float(rows[0][2]) < 0.9, rows  # it learned it: the first step guessed
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 1000
    assert (tmp_path / "demo" / "checkpoint" / "policies.json").exists()


def test_a_call_another_model_answered_is_not_trained_as_its_agents_policy() -> None:
    from agl_core.schema import Trajectory, Transition
    from agl_trainer.policies import split_by_policy

    def call(i: int, agent: str, model: str | None) -> Transition:
        return Transition(rollout_id="r", task_id="t", index=i, prompt=PROMPT, agent_name=agent, model=model,
                          response={"role": "assistant", "content": "A"})

    router = PolicyRouter(POLICIES)
    traj = Trajectory(rollout_id="r", task_id="t", transitions=[
        call(0, "writer", "writer"), call(1, "writer", "base"), call(2, "checker", None), call(3, "judge", "base")])
    elsewhere: dict[str, int] = {}
    shares = split_by_policy([traj], router, elsewhere)
    assert [t.index for t in shares["writer"][0].transitions] == [0]  # the base's answer is not the writer's sample
    assert [t.index for t in shares["checker"][0].transitions] == [2]
    assert elsewhere == {"writer": 1}


# ---------------------------------------------------------------------- a policy with a model of its own


def _judge() -> Any:
    """Another tiny model (another shape, other weights) over the same tokenizer: the checker's own."""
    spec = PolicySpec(["user", "assistant", "say", "one"], [], ["A", "B"])
    return build_model(build_tokenizer(spec), spec, seed=3, hidden=48, layers=2)


def _judge_own_vocab() -> tuple[Any, Any]:
    """A tiny model with a tokenizer of its own (two more words first: every id differs from the base's)."""
    spec = PolicySpec(["please", "judge", "user", "assistant", "say", "one"], [], ["A", "B"])
    tokenizer = build_tokenizer(spec)
    return build_model(tokenizer, spec, seed=3, hidden=48, layers=2), tokenizer


def _state(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _seq_logprobs(model: Any, t: Any) -> list[float]:
    ids = list(t.prompt_token_ids) + list(t.response_token_ids)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    start = len(t.prompt_token_ids)
    return [float(logp[start + i - 1, tok]) for i, tok in enumerate(t.response_token_ids)]


def _mixed(base: Any, judge: Any, tokenizer: Any, judge_tokenizer: Any = None) -> MultiPolicyBackend:
    """The writer an adapter on the base, the checker its own model (fully fine-tuned, at a lower lr)."""
    config = TorchConfig(lr=5e-2, epochs=3, minibatches=2, gradient_checkpointing=False)
    return MultiPolicyBackend(base, [Policy("writer", "^writer$", LORA), Policy("checker", "^checker$", None)],
                              config, pad_id=tokenizer.pad_token_id, models={"checker": judge},
                              tokenizers={"checker": copy.deepcopy(judge_tokenizer or tokenizer)},
                              configs={"checker": TorchConfig(**{**config.__dict__, "lr": 5e-3})})


def test_a_policy_with_its_own_model_is_served_trained_and_resumed_beside_an_adapter(tmp_path: Path) -> None:
    base, tokenizer = _tiny()
    judge = _judge()
    multi = _mixed(copy.deepcopy(base), copy.deepcopy(judge), tokenizer)
    assert multi.separate == ["checker"] and multi.backends["checker"].model is not multi.model
    assert multi.backends["checker"].config.lora is None  # full fine-tuning: every weight of its own model trains
    assert multi.backends["checker"].config.lr == 5e-3 and multi.backends["writer"].config.lr == 5e-2
    run = Run(tmp_path, multi, tokenizer, [{"id": 1, "roles": ["checker"]}], router=multi.router)
    try:
        assert run.engine.engines["checker"].model is multi.backends["checker"].model  # one set of weights
        # a step with the checker's calls only: its model moves, the base and the writer's adapter do not
        judge_before, base_before = _state(multi.backends["checker"].model), _state(multi.model)
        step = run.trainer.step()
        assert step.metrics["policy/writer/rows"] == 0 and step.metrics["policy/checker/rows"] > 0, step.metrics
        assert _same(_state(multi.model), base_before)
        moved = [k for k, v in _state(multi.backends["checker"].model).items() if not torch.equal(v, judge_before[k])]
        assert len(moved) > 10, moved  # full fine-tuning: the layers, not one tensor

        # those calls were answered by the checker's own model: its recorded logprobs are that model's forward pass
        rollout = run.server.store.rollouts()[-1]
        traj = run.server.store.trajectories(rollout_ids=[rollout.id])[0]
        (t,) = traj.transitions
        assert t.agent_name == "checker" and t.model == "checker"
        sampler = copy.deepcopy(judge)
        sampler.load_state_dict(judge_before)
        expected = _seq_logprobs(sampler, t)
        assert t.response_logprobs == pytest.approx(expected, abs=1e-4)
        with multi.model.disable_adapter():
            on_base = _seq_logprobs(multi.model, t)
        assert all(abs(a - b) > 1e-3 for a, b in zip(on_base, expected, strict=True)), (on_base, expected)

        # a step with the writer's calls only: its adapter moves, the checker's model does not
        run.trainer.tasks = [{"id": 2, "roles": ["writer"]}]
        judge_before, writer_before = _state(multi.backends["checker"].model), _adapter_weights(multi, "writer")
        step = run.trainer.step()
        assert step.metrics["policy/checker/rows"] == 0 and step.metrics["policy/writer/rows"] > 0, step.metrics
        assert _same(_state(multi.backends["checker"].model), judge_before)
        assert not _same(_adapter_weights(multi, "writer"), writer_before)

        # each role learns its own answer (the writer A on the base's adapter, the checker B on its own model), one
        # role's rollouts a step in turn: each policy's reward is its own role's, up to 0.5
        run.trainer.tasks = [{"id": 3, "roles": ["writer"]}, {"id": 4, "roles": ["checker"]}]
        history = run.trainer.run(multi.step + 30, stop=lambda h: len(h) >= 2 and min(h[-1].reward, h[-2].reward)
                                  >= 0.45)
        rewards = [round(h.reward, 2) for h in history]
        print(f"writer adapter + checker model, by turns: {rewards}")
        assert min(history[-1].reward, history[-2].reward) >= 0.45, rewards  # 90% of each role right
        assert {h.metrics["policy/writer/rows"] > 0 for h in history[-2:]} == {True, False}  # one of each role
        for step_ in history:  # each call sampled from its own policy: the trainer's first ratio is 1
            for name in ROLES:
                if step_.metrics.get(f"policy/{name}/rows"):
                    assert step_.metrics[f"policy/{name}/ratio_first_mean"] == pytest.approx(1.0, abs=2e-2)
        run.trainer.save()
        saved_judge, saved_writer, steps = _state(multi.backends["checker"].model), \
            _adapter_weights(multi, "writer"), multi.step
    finally:
        run.close()

    assert (tmp_path / "ckpt" / "policies" / "checker" / "trainer.pt").exists()
    again = _mixed(copy.deepcopy(base), copy.deepcopy(judge), tokenizer)
    assert not _same(_state(again.backends["checker"].model), saved_judge)
    again.load(tmp_path / "ckpt")
    assert again.step == steps
    assert _same(_state(again.backends["checker"].model), saved_judge)
    assert _same(_adapter_weights(again, "writer"), saved_writer)


def test_a_separate_model_needs_loading_and_is_refused_with_vllm() -> None:
    from agl_trainer.config import ConfigError, validate
    from agl_trainer.policies import policies_of

    config = validate(_raw(policies={"writer": {"agents": "writ"}, "judge": {"agents": "judge", "model": "j"},
                                     "critic": {"agents": "crit", "model": "c", "lora": {"r": 2}}},
                           backend={"model": "m", "lora": {"r": 4}}))
    by_name = {p.name: p for p in policies_of(config)}
    assert by_name["writer"].model is None and by_name["writer"].lora is not None and by_name["writer"].lora.r == 4
    assert by_name["judge"].model == "j" and by_name["judge"].lora is None  # its own model: fully fine-tuned
    assert by_name["critic"].lora is not None and by_name["critic"].lora.r == 2  # or its own LoRA, not backend.lora
    with pytest.raises(ConfigError, match=r"^config error: policies\.judge\.model: .*not with backend\.vllm"):
        validate(_raw(policies={"judge": {"agents": "judge", "model": "j"}},
                      backend={"model": "m", "vllm": {"url": "http://127.0.0.1:8000/v1"}}))
    base, _ = _tiny()
    with pytest.raises(ValueError, match=r"policies \['judge'\] name a model of their own"):
        MultiPolicyBackend(base, [Policy("judge", "judge", None, model="j")])


@pytest.mark.parametrize("stream", [False, True])
def test_a_separate_models_agent_is_answered_by_that_model_streamed_too(make_server: Any, stream: bool) -> None:
    base, tokenizer = _tiny()
    judge, judge_tokenizer = _judge_own_vocab()  # its own vocabulary: its prompt is tokenised by its tokenizer
    multi = _mixed(base, judge, tokenizer, judge_tokenizer)
    engine = multi.engine(tokenizer, name="base", seed=0, default_max_tokens=1)
    server = make_server(engine, gateway=GatewayConfig(policies=multi.router))
    own = judge_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    on_base = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    own, on_base = list(getattr(own, "input_ids", own)), list(getattr(on_base, "input_ids", on_base))
    assert own != on_base
    for role, served_by in (("checker", "checker"), ("writer", "writer"), ("judge", "base")):
        served, rollout_id = _rollout(server.url, role, stream=stream)
        assert served == served_by, role
        logprob, prompt, response, attrs = _recorded_logprob(server.server.store, rollout_id)
        assert prompt == (own if served_by == "checker" else on_base), role
        if served_by == "checker":  # the judge's own forward pass gave the recorded logprob
            judge_lp = _seq_logprobs(judge, type("T", (), {"prompt_token_ids": prompt, "response_token_ids": response}))
            assert logprob == pytest.approx(judge_lp[0], abs=1e-4)
            assert attrs.get(semconv.AGL_POLICY) == "checker"
        else:
            assert logprob == pytest.approx(_logprob(multi.model, prompt, response[0],
                                                     "writer" if served_by == "writer" else None), abs=1e-4)
        traj = server.server.store.trajectories(rollout_ids=[rollout_id])[0]
        assert [t.model for t in traj.transitions] == [served_by]
    assert sorted(asyncio_run(engine.models())) == ["base", "checker", "writer"]


def asyncio_run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


def test_agl_train_trains_a_policy_of_its_own_model_from_a_config_and_resumes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_trainer.config import validate
    from agl_trainer.train_cli import run_training

    model, tokenizer = _tiny()
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    judge, judge_tokenizer = _judge_own_vocab()
    judge.save_pretrained(tmp_path / "judge")
    judge_tokenizer.save_pretrained(tmp_path / "judge")
    (tmp_path / "roles_agent.py").write_text(ROLES_AGENT, encoding="utf-8")
    (tmp_path / "tasks.jsonl").write_text('{"id": 0}\n', encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = {"data": {"path": "tasks.jsonl", "group_size": 4, "tasks_per_step": 1}, "agent": "roles_agent:solve",
           "backend": {"model": "policy", "threads": 1, "gradient_checkpointing": False,
                       "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}},
           "algorithm": {"lr": 1e-2},
           "policies": {"writer": {"agents": "^writer$"},
                        "checker": {"agents": "^checker$", "model": "judge", "lr": 1e-3}},
           "workers": {"count": 4}, "run": {"steps": 1, "dir": "out", "checkpoint_every": 1}}
    outcome = run_training(validate(raw, base_dir=str(tmp_path)), progress=False)
    metrics = outcome.steps[-1]["metrics"]
    for name in ("writer", "checker"):
        assert metrics[f"policy/{name}/transitions"] == 4 and metrics[f"policy/{name}/rows"] > 0, metrics
        assert not metrics.get(f"policy/{name}/served_elsewhere"), metrics  # each call answered by its own policy
    state = torch.load(tmp_path / "out" / "checkpoint" / "policies" / "checker" / "trainer.pt", weights_only=True)
    shapes = {tuple(v.shape) for k, v in state["model"].items()}
    assert not any("lora" in k for k in state["model"]) and (48, 48) in shapes  # the judge itself, every weight
    raw["run"]["steps"] = 2
    again = run_training(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert again.resumed and [s["step"] for s in again.steps] == [1, 2]


def test_the_steps_signal_figures_keep_the_worst_policys_not_the_mean() -> None:
    from agl_trainer.policies import _joined

    # a writer drifting up and a checker drifting down are no healthy 1.0 (the ratio-drift warning reads the step's)
    assert _joined("ratio_first_mean", [1.3, 0.7]) == pytest.approx(1.3)
    assert _joined("ratio_first_mean", [1.0, 0.8]) == pytest.approx(0.8)
    assert _joined("ratio_first_min", [0.9, 0.5]) == 0.5 and _joined("ratio_first_max", [1.1, 2.0]) == 2.0
    assert _joined("sampler_kl", [0.01, 0.2]) == 0.2
    assert _joined("skipped_steps", [0.0, 1.0]) == 1.0 and _joined("rows", [3.0, 4.0]) == 7.0
    assert _joined("loss", [1.0, 3.0]) == 2.0
