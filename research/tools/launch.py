"""Start N local processes of one experiment on 127.0.0.1 (`scripts/launch`).

    scripts/launch --num-processes 2 -- mnist1d --model cnn [flags]

Each process runs the experiment's script (`experiments/EXPERIMENT.py`, or a script path) with
`JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`, `JAX_NUM_PROCESSES=N` and `JAX_PROCESS_ID=i`, which the
experiment's `research.cli.main_entry` turns into `jax.distributed.initialize` with gloo collectives.
When one process fails, the others get up to 20 s to notice and exit on their own, are then
stopped, and the launcher exits with the failed process's status; Ctrl-C stops them all.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .. import install
from ..errors import ConfigError
from ..experiment import experiment_script
from ..messages import messages_to_stderr
from ..parallel import LOST_PEER_STATUS


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_path(experiment: str) -> Path:
    try:
        return experiment_script(experiment)
    except ConfigError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


SETTLE_SECONDS = 20.0  # what the others get to notice a failed process and exit on their own
PREEMPTED = (143, 130)  # a process stopped by SIGTERM / SIGINT after its checkpoint


def _describe(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def settle(processes: list[subprocess.Popen], seconds: float) -> None:
    """Wait up to `seconds` for every process to exit on its own: one blocked in a collective fails
    as soon as its peer is gone, one still compiling reaches its next collective and fails there."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)


def stop(processes: list[subprocess.Popen], grace_seconds: float = 5.0) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_seconds
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    num_processes: int, command: list[str], *, port: int | None = None, settle_seconds: float = SETTLE_SECONDS
) -> int:
    """Run `command` (an experiment and its flags) in `num_processes` processes; return the exit status.
    When one fails, the others get `settle_seconds` to notice the lost peer and exit on their own
    (saying where they were) before they are terminated."""
    script = script_path(command[0])
    address = f"127.0.0.1:{port or free_port()}"
    processes: list[subprocess.Popen] = []
    forward = lambda number, frame: [p.send_signal(number) for p in processes if p.poll() is None]  # noqa: E731
    previous = {number: signal.signal(number, forward) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _watch(processes, script, command, address, num_processes, settle_seconds)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _watch(
    processes: list[subprocess.Popen],
    script: Path,
    command: list[str],
    address: str,
    num_processes: int,
    settle_seconds: float,
) -> int:
    """Start the processes and wait: the first failure stops the others. SIGTERM and SIGINT are
    passed on to every process (they stop together, after a checkpoint, with 143 or 130)."""
    for index in range(num_processes):
        env = {
            **os.environ,
            "JAX_COORDINATOR_ADDRESS": address,
            "JAX_NUM_PROCESSES": str(num_processes),
            "JAX_PROCESS_ID": str(index),
        }
        processes.append(subprocess.Popen([sys.executable, str(script), *command[1:]], env=env))
    try:
        while True:
            statuses = [p.poll() for p in processes]
            failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
            if failed and all(s in PREEMPTED for s in statuses):
                print(
                    f"launch: every process stopped on a signal (status {statuses[0]}); rerun with --resume auto "
                    "to continue",
                    file=sys.stderr,
                )
                return max(s for s in statuses if s is not None)  # all of them: each stopped on a signal
            if failed and not all(s in PREEMPTED or s is None for s in statuses):
                # A process that lost a peer is a consequence; report the cause when it is known.
                index, status = min(failed, key=lambda f: f[1] == LOST_PEER_STATUS)
                running = [i for i, s in enumerate(statuses) if s is None]
                print(
                    f"launch: process {index} {_describe(status)}"
                    + (f"; stopping process(es) {', '.join(map(str, running))}" if running else ""),
                    file=sys.stderr,
                )
                settle(processes, settle_seconds)
                stop(processes)
                return status if status > 0 else 128 - status
            if all(s == 0 for s in statuses):
                return 0
            time.sleep(0.2)
    finally:
        stop(processes)  # none is left running, whatever ended the wait


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="launch",
        usage=f"{install.command('launch')} --num-processes N [--port PORT] -- EXPERIMENT [flags]",
        description="Run an experiment in N local processes (jax.distributed over 127.0.0.1, gloo collectives). "
        f"When one fails, the others get {SETTLE_SECONDS:.0f} s to exit on their own, are then stopped, and "
        "the launcher exits with the failed process's status.",
    )
    parser.add_argument("--num-processes", type=int, required=True, help="number of processes to start")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    args = parser.parse_args(own)
    if args.num_processes < 1:
        parser.exit(2, "launch: error: --num-processes must be positive\n")
    if not command:
        example = f"{install.command('launch')} --num-processes 2 -- xor"
        parser.exit(2, f"launch: error: name an experiment after '--', e.g. {example}\n")
    raise SystemExit(launch(args.num_processes, command, port=args.port))


if __name__ == "__main__":
    main()
