"""``agl worker``: lease tasks from an agl server and run an agent on each (see :mod:`agl_core.worker`)."""

from __future__ import annotations

import logging

import click

__all__ = ["worker"]


@click.command("worker", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--server", required=True, metavar="URL", help="the server's URL, e.g. http://127.0.0.1:8000")
@click.option("--agent", metavar="MODULE:FUNCTION", help="the agent function, as pkg.module:function")
@click.option("--command", metavar="COMMAND",
              help="or the agent as a command line, run once per task with OPENAI_BASE_URL scoped to its rollout and "
                   "the task on stdin; its last JSON line on stdout is the reward (see agl_core.command_agent)")
@click.option("--command-timeout", type=click.FloatRange(min=0, min_open=True),
              help="seconds one run of --command may take before it is killed (its rollout fails)")
@click.option("-n", "--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="rollouts at a time (with --ray: actors)")
@click.option("--token", envvar="AGL_TOKEN", help="the server's bearer token [env: AGL_TOKEN]")
@click.option("--worker-id", help="name for this worker in the server's records")
@click.option("--lease-timeout", type=click.FloatRange(min=0, min_open=True),
              help="seconds a lease lasts without a heartbeat")
@click.option("--grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="seconds in-flight rollouts get on SIGTERM")
@click.option("--max-tasks", type=click.IntRange(min=1), help="stop after this many tasks")
@click.option("--idle-exit", type=click.FloatRange(min=0), help="stop once no task has come for this many seconds")
@click.option("--poll", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="seconds one lease request waits for a task")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="run the workers as Ray actors on this cluster (an address as ray.init takes it; 'local' starts "
                   "one here): -n actors of one slot each")
@click.option("--actor-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="CPUs Ray reserves per actor (with --ray)")
@click.option("--no-gateway-env", is_flag=True, help="leave OPENAI_BASE_URL and OPENAI_API_KEY as they are")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False))
def worker(server: str, agent: str | None, command: str | None, command_timeout: float | None, concurrency: int,
           token: str | None, worker_id: str | None, lease_timeout: float | None, grace: float,
           max_tasks: int | None, idle_exit: float | None, poll: float, ray_address: str | None, actor_cpus: float,
           no_gateway_env: bool, log_level: str) -> None:
    """Lease tasks from an agl server and run an agent on each, with the server's gateway as the agent's
    OpenAI endpoint (OPENAI_BASE_URL and OPENAI_API_KEY are set before the agent is imported).

    SIGTERM or Ctrl-C stops leasing and gives the rollouts in flight --grace seconds; a second one
    releases them at once.
    """
    from agl_core.worker import Worker, run_on_ray

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if ray_address:
        if agent is None:
            raise click.UsageError("--ray runs an --agent function; --command runs on this machine")
        stats = run_on_ray(ray_address, server, agent, actors=concurrency, token=token, actor_cpus=actor_cpus,
                           worker_id=worker_id, lease_timeout=lease_timeout, grace_s=grace, max_tasks=max_tasks,
                           idle_exit_s=idle_exit, poll_s=poll, set_openai_env=not no_gateway_env)
        click.echo(f"agl worker: done on Ray: {stats}")
        return
    try:
        running = Worker(server, agent, command=command, command_timeout_s=command_timeout, token=token,
                         concurrency=concurrency, worker_id=worker_id, lease_timeout=lease_timeout, grace_s=grace,
                         max_tasks=max_tasks, idle_exit_s=idle_exit, poll_s=poll, set_openai_env=not no_gateway_env)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"agl worker: {running.worker_id} working for {running.url} with {concurrency} slot(s)")
    stats = running.run()
    if running.unreachable is not None:
        click.echo(f"agl worker: stopped: {running.unreachable}", err=True)
        raise SystemExit(1)
    click.echo(f"agl worker: done: {stats}")
