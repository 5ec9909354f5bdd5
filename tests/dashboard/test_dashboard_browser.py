"""The dashboard in headless chromium: the page lists the stored rollouts, shows a rollout's tree, draws the curves.

Every check reads what the browser rendered from the real server, which holds
real rollouts (see ``sample_runs``). The page must make no request beyond the
server, and log no script error.
"""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import expect

from . import sample_runs
from .conftest import TOKEN, Filled


def _only_this_server(page: Any, url: str) -> None:
    elsewhere = [u for u in page.requests_seen if not u.startswith(url + "/")]
    assert elsewhere == [], f"the page fetched beyond the server: {elsewhere}"
    assert page.console_errors == [], page.console_errors


def test_lists_rollouts_opens_a_tree_and_draws_curves(filled: Filled, page: Any) -> None:
    page.goto(filled.url + "/")
    rows = page.locator("#rollouts tbody tr[data-rollout-id]")
    expect(rows).to_have_count(len(sample_runs.QUESTIONS))
    # newest first, with status and reward
    assert rows.nth(0).get_attribute("data-rollout-id") == filled.runs[-1].id
    expect(rows.nth(0).locator("td.task")).to_have_text("calc-6")
    expect(rows.nth(0).locator(".badge")).to_have_text("succeeded")
    expect(rows.nth(0).locator("td.reward")).to_have_text("0.5")
    failed = page.locator("#rollouts tbody tr", has_text="calc-3")
    expect(failed.locator(".badge")).to_have_text("failed")
    expect(failed.locator("td.err-text")).to_contain_text("ZeroDivisionError")
    expect(page.locator("#page-info")).to_have_text("1–6 of 6")

    # open calc-4: solver agent -> LLM calls and the calculator (which returned an error), checker, reward
    page.locator("#rollouts tbody tr", has_text="calc-4").click()
    expect(page.locator("#rollouts tbody tr.selected td.task")).to_have_text("calc-4")
    tree = page.locator("#tree")
    expect(tree.locator(".node.k-rollout")).to_have_count(1)
    expect(tree.locator(".node.k-agent")).to_have_text([re.compile("solver"),
                                                        re.compile("checker")])
    expect(tree.locator(".node.k-llm")).to_have_count(3)
    tool = tree.locator(".node.k-tool")
    expect(tool).to_have_count(1)
    expect(tool).to_contain_text("calculator")
    expect(tool).to_have_class(re.compile(r"\berror\b"))
    expect(tool.locator(".errmsg")).to_contain_text("only arithmetic is allowed")
    expect(tree.locator(".node.k-reward .reward")).to_have_text("reward 0")
    expect(tree.locator(".node.k-rollout .reward")).to_have_text("reward 0")
    # LLM and tool spans sit under the solver's agent span
    solver_item = tree.locator("li", has=page.locator(":scope > .node.k-agent", has_text="solver"))
    expect(solver_item.locator(".node.k-llm")).to_have_count(2)
    expect(solver_item.locator(".node.k-tool")).to_have_count(1)

    # each LLM call with its tokens, output and transition (all three are trained: no agent_match)
    llm = tree.locator(".node.k-llm")
    expect(llm.locator(".transition")).to_have_text(["transition #0", "transition #1", "transition #2"])
    expect(llm.nth(0).locator(".out")).to_contain_text("→ calculator(")
    expect(llm.nth(0).locator(".tokens")).to_have_text(re.compile(r"^\d+ in / \d+ out tokens$"))
    expect(llm.nth(2).locator(".out")).to_have_text('→ "Checked: looks right."')
    expect(llm.locator(".credited")).to_have_text(["credited 0"] * 3)

    # a span's attributes and messages on click
    tool.click()
    detail = page.locator("#span-detail")
    expect(detail.locator("h3").first).to_have_text("tool: calculator")
    expect(detail.locator("table.attrs")).to_contain_text("agl.tool.status")
    expect(detail.locator("table.attrs")).to_contain_text("error: only arithmetic is allowed")
    tree.locator(".node.k-llm").first.click()
    expect(detail.locator(".msg.user")).to_contain_text("compute: two plus two")
    expect(detail.locator(".msg.assistant")).to_contain_text("calculator")

    # the failed rollout: the model's 500 is highlighted
    page.locator("#rollouts tbody tr", has_text="calc-5").click()
    expect(page.locator("#detail-title")).to_contain_text("failed")
    expect(tree.locator(".node.k-llm.error")).to_have_count(1)

    # the curves: one per metric, reward first, a point per step
    curves = page.locator("#curves svg.curve")
    expect(curves).to_have_count(2)
    assert curves.nth(0).get_attribute("data-metric") == "reward_mean"
    assert curves.nth(1).get_attribute("data-metric") == "loss"
    points = curves.nth(0).locator("polyline").get_attribute("points")
    assert points is not None and len(points.split()) == sample_runs.N_STEPS
    ys = [float(p.split(",")[1]) for p in points.split()]
    assert ys[-1] < ys[0]  # the reward rises: up the chart, which is smaller y in SVG
    expect(curves.nth(0).locator("circle")).to_have_count(sample_runs.N_STEPS)
    expect(page.locator("#curves-hint")).to_have_text(f"{sample_runs.N_STEPS} steps · 2 of 3 metrics")
    page.check("#all-metrics")
    expect(curves).to_have_count(3)
    assert curves.nth(2).get_attribute("data-metric") == "kl"

    # per-agent calls and error rates
    expect(page.locator("#stats tbody tr[data-agent=solver] td").nth(2)).to_have_text("10")
    expect(page.locator("#stats tbody tr[data-agent=solver] td").nth(3)).to_have_text("1 (10%)")
    expect(page.locator("#stats tbody tr[data-agent=solver] td").nth(5)).to_have_text("2 (40%)")
    expect(page.locator("#stats tbody tr[data-agent=checker] td").nth(2)).to_have_text("4")
    _only_this_server(page, filled.url)


def test_status_filter_and_paging(filled: Filled, page: Any) -> None:
    page.goto(filled.url + "/dashboard")
    rows = page.locator("#rollouts tbody tr[data-rollout-id]")
    expect(rows).to_have_count(6)
    page.select_option("#status-filter", "failed")
    expect(rows).to_have_count(2)
    expect(page.locator("#rollouts .badge")).to_have_text(["failed", "failed"])
    expect(page.locator("#page-info")).to_have_text("1–2 of 2")
    page.select_option("#status-filter", "timeout")
    expect(rows).to_have_count(0)
    expect(page.locator("#rollouts tbody")).to_contain_text("no rollouts with this status")
    page.select_option("#status-filter", "")
    expect(rows).to_have_count(6)
    expect(page.locator("#next")).to_be_disabled()
    _only_this_server(page, filled.url)


def test_token_from_the_address_once_then_from_the_tab(filled_with_token: Filled, page: Any) -> None:
    url = filled_with_token.url
    # without the token: the page loads, asks for it, and shows no data
    page.goto(url + "/")
    expect(page.locator("#token-panel")).to_be_visible()
    expect(page.locator("#main")).to_be_hidden()
    assert page.locator("#rollouts tbody tr[data-rollout-id]").count() == 0

    # a wrong token pasted: refused, still no data
    page.fill("#token-input", "wrong")
    page.click("#token-form button")
    expect(page.locator("#token-error")).to_have_text("the token was refused")
    expect(page.locator("#main")).to_be_hidden()

    # ?token= once: used, kept for this tab, and gone from the address bar
    page.goto(url + f"/?token={TOKEN}")
    rows = page.locator("#rollouts tbody tr[data-rollout-id]")
    expect(rows).to_have_count(6)
    assert "token" not in page.url
    assert page.evaluate("sessionStorage.getItem('agl.token')") == TOKEN
    page.reload()
    expect(rows).to_have_count(6)
    expect(page.locator("#curves svg.curve")).to_have_count(2)

    # a new tab starts without it
    other = page.context.new_page()
    try:
        other.goto(url + "/")
        expect(other.locator("#token-panel")).to_be_visible()
        other.fill("#token-input", TOKEN)
        other.click("#token-form button")
        expect(other.locator("#rollouts tbody tr[data-rollout-id]")).to_have_count(6)
    finally:
        other.close()


def test_markup_in_stored_data_is_shown_as_text(tmp_path: Any, page: Any) -> None:
    """Task ids, tool results and messages come from agents and models: the page never runs them as markup."""
    import agl_core as agl
    from agl_core.testing import FakeOpenAI
    from agl_trainer.gateway import OpenAIBackend
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

    evil = '<img src=x onerror="document.body.dataset.pwned=1">'
    with FakeOpenAI(script=[evil]) as fake:
        server = TrainerServer(ServerConfig(db_path=str(tmp_path / "agl.db"), port=0), OpenAIBackend(fake.url))
        with ServerThread(server) as thread:
            import openai

            client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
            with agl.rollout(task_id=evil, store=agl.HttpStore(thread.url)):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": evil}])
                agl.emit_reward(1.0)
            server.record_metrics(0, {evil: 1.0})
            page.goto(thread.url + "/")
            expect(page.locator("#rollouts td.task")).to_have_text(evil)
            page.locator("#rollouts tbody tr[data-rollout-id]").click()
            page.locator("#tree .node.k-llm").click()
            expect(page.locator("#span-detail .msg.user")).to_contain_text(evil)
            expect(page.locator("#span-detail .msg.assistant")).to_contain_text(evil)
            expect(page.locator("#curves svg.curve")).to_have_count(1)
            assert page.locator("img").count() == 0
            assert page.evaluate("document.body.dataset.pwned") is None
            _only_this_server(page, thread.url)


def test_the_training_signal_panel_shows_the_last_steps_health_and_marks_what_the_trainer_flagged(
        tmp_path: Any, page: Any) -> None:
    from agl_core.schema import Trajectory, Transition
    from agl_trainer.gateway import OpenAIBackend
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer
    from agl_trainer.signal_health import warning_flags
    from agl_trainer.training import TrainConfig, score_batch

    def run(rid: str, task: str, reward: float) -> Trajectory:  # two groups whose rollouts agree: no spread
        t = Transition(rollout_id=rid, task_id=task, index=0, prompt=[{"role": "user", "content": "q"}],
                       response={"role": "assistant", "content": "a"}, prompt_token_ids=[1, 2],
                       response_token_ids=[3], response_logprobs=[-0.5], token_source="gateway", credited_reward=reward)
        return Trajectory(rollout_id=rid, task_id=task, transitions=[t], reward=reward)

    signal = score_batch([run("a", "x#0", 1.0), run("b", "x#1", 1.0), run("c", "y#0", 0.0), run("d", "y#1", 0.0)],
                         TrainConfig()).signal()
    values = {**signal, "ratio_first_mean": 1.0, "ratio_first_min": 0.998, "ratio_first_max": 1.002,
              "sampler_kl": 1e-6, "clip_fraction": 0.0, "reward_mean": 0.5, "loss": 0.0}
    values.update(warning_flags(values))  # what the trainer records with each step
    server = TrainerServer(ServerConfig(db_path=str(tmp_path / "agl.db"), port=0), OpenAIBackend("http://127.0.0.1:9/v1"))
    with ServerThread(server) as thread:
        server.record_metrics(3, values)
        page.goto(thread.url + "/")
        table = page.locator("#signal tbody")
        expect(table.locator("tr[data-signal='first-pass importance ratio'] td").nth(1)).to_have_text("1 (0.998–1.002)")
        flat = table.locator("tr[data-signal='groups without spread']")
        expect(flat.locator("td").nth(1)).to_have_text("2 of 2")
        expect(flat).to_have_class("signal-bad")  # the trainer flagged it: warn_flat_groups
        expect(table.locator("tr.signal-bad")).to_have_count(1)
        expect(page.locator("#signal-hint")).to_have_text("step 3 · 1 warning: see the marked rows")
        _only_this_server(page, thread.url)


def test_the_validation_reward_is_a_curve_of_its_own_steps(page: Any, tmp_path: Any) -> None:
    """As ``agl train`` records them: a validation before step 1 and after steps 2 and 4, training steps 1-4."""
    from agl_trainer.gateway import OpenAIBackend
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer
    from agl_trainer.training import ValidationResult

    server = TrainerServer(ServerConfig(db_path=str(tmp_path / "agl.db"), port=0), OpenAIBackend("http://127.0.0.1:9/v1"))
    with ServerThread(server) as thread:
        for step in range(1, 5):
            server.record_metrics(step, {"reward_mean": 0.1 * step, "loss": 1.0 / step, "no_reward_rollouts": 0.0})
        for step, reward in [(0, 0.2), (2, 0.5), (4, 0.75)]:
            validation = ValidationResult(step=step, reward=reward, rollouts=4, failed_rollouts=0, failed_tasks=0,
                                          no_reward=0, rollout_s=1.0, version=step, time=0.0)
            server.record_metrics(step, validation.values())
        page.goto(thread.url + "/")
        curves = page.locator("#curves svg.curve")
        expect(curves).to_have_count(3)  # reward and loss curves: the validation's reward is one, no count of them
        assert [curves.nth(i).get_attribute("data-metric") for i in range(3)] == [
            "reward_mean", "validation_reward_mean", "loss"]
        validation_curve = page.locator("#curves svg.curve[data-metric='validation_reward_mean']")
        assert validation_curve.get_attribute("data-points") == "3"
        expect(validation_curve.locator("text.title")).to_have_text("validation_reward_mean  (last 0.75)")
        expect(validation_curve).to_contain_text("step 0")  # it starts before the first training step
        expect(page.locator("#signal-hint")).to_have_text("step 4")
        _only_this_server(page, thread.url)


def test_each_call_says_which_policy_answered_it_or_why_the_base_model_did(tmp_path: Any, page: Any) -> None:
    """A run of several policies: the gateway routes each agent's call to its policy (here vLLM's LoRA name)."""
    import openai

    import agl_core as agl
    from agl_core.testing import FakeOpenAI
    from agl_trainer.gateway import GatewayConfig, OpenAIBackend
    from agl_trainer.policies import Policy, PolicyRouter
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

    router = PolicyRouter([Policy("writer", "^writer$"), Policy("checker", "^checker$")])
    with FakeOpenAI(enable_lora=True) as vllm:
        vllm.adapters.update({"writer": str(tmp_path / "w"), "checker": str(tmp_path / "c")})
        server = TrainerServer(ServerConfig(db_path=str(tmp_path / "agl.db"), port=0,
                                            gateway=GatewayConfig(policies=router)), OpenAIBackend(vllm.url))
        with ServerThread(server) as thread:
            client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
            with agl.rollout(task_id="roles", store=agl.HttpStore(thread.url)):
                for agent in ("writer", "checker", "judge"):  # as the instrumented client says, in an agent scope
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": agent}],
                                                   extra_headers={"X-Agl-Agent": agent})
                agl.emit_reward(1.0)
            assert [r.body["model"] for r in vllm.requests if r.path.endswith("/chat/completions")] == [
                "writer", "checker", vllm.model]
            page.goto(thread.url + "/")
            page.locator("#rollouts tbody tr[data-rollout-id]").click()
            calls = page.locator("#tree .node.k-llm")
            expect(calls).to_have_count(3)
            expect(calls.nth(0).locator(".policy")).to_have_text("policy writer")
            expect(calls.nth(1).locator(".policy")).to_have_text("policy checker")
            base = calls.nth(2).locator(".policy.base")
            expect(base).to_have_text("base model")
            assert "'judge' matches no policy" in (base.get_attribute("title") or "")
            _only_this_server(page, thread.url)
