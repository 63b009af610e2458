"""Runs N processes of one command on this machine as one multi-controller program.

    python launch/local.py -n 2 --generation_processes 1 [--scoring_processes 0] [--pin] -- \
        python -m my.entry --flag=value

Each child gets the environment `streamrl_jax.distributed.roles` reads:
STREAMRL_COORDINATOR (127.0.0.1:<free port>), STREAMRL_NUM_PROCESSES,
STREAMRL_PROCESS_ID, STREAMRL_GENERATION_PROCESSES, STREAMRL_SCORING_PROCESSES,
STREAMRL_HOST=127.0.0.1,
and STREAMRL_AUTHKEY (a fresh random run secret, unless STREAMRL_AUTHKEY or
STREAMRL_AUTHKEY_FILE is set already; in the environment, which other users
cannot read, never on a command line). Child
output is streamed line by line, prefixed `[p<id> <role>]` (gen, train, score). `--pin` runs
child i under `taskset -c <cpu i mod #cpus>` (the honest CPU stand-in for
separate hardware, DESIGN.md §5).

If a child fails (non-zero exit or a signal), every other child gets SIGTERM
and, after `--grace_s`, SIGKILL (JAX catches SIGTERM); the launcher exits with
the first failing child's code (128 + signal for a signal). `--timeout_s`
bounds the whole run (exit 124). Children that exit 0 early are left be.
`--pids_file PATH` writes `{process id: [pid, role]}` once every child is started
(each child leads its own process group), e.g. for `tools/fault_drill.py --processes`.

`--restart_generation K`: a generation child that fails while a training child is
still running is started again (the same command and environment, so the same
process id: it rejoins the run, docs/multicontroller.md "Losing a process"), at most
K times over the run, `--restart_delay_s` after its failure; the others keep running.
`--restart_scoring K` does the same for a scoring child (`-s`: the last S processes serve
the run's judge, docs/reward_models.md "Scoring processes").
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The program's environment and supervision live in the package (the main job's stage
# processes and the tests use them too); re-exported here for launch/ray_cluster.py.
from streamrl_jax.distributed.local_program import (  # noqa: E402
    child_env,
    exit_code,
    free_port,
    process_env,
    role_name,
    run_secret,
    supervise,
)

__all__ = ["child_env", "exit_code", "free_port", "process_env", "role_name", "run_secret"]


def program_parser(doc: str, pids: str) -> argparse.ArgumentParser:
    """The flags every launcher of the program takes (the process counts, the coordinator
    port, stopping, restarts, the pids file, the command after `--`); `doc`: the
    launcher's module docstring, `pids`: what its pids file holds for each process."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("-n", "--num_processes", type=int, required=True)
    parser.add_argument("-g", "--generation_processes", type=int, default=1)
    parser.add_argument(
        "-s",
        "--scoring_processes",
        type=int,
        default=0,
        help="the last S processes serve the run's judge (judge.model)",
    )
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--grace_s", type=float, default=3.0)
    parser.add_argument("--timeout_s", type=float, default=0.0, help="0: no limit")
    parser.add_argument(
        "--pids_file",
        default="",
        help=f"write {{process id: {pids}}} here as JSON (drills, supervisors)",
    )
    parser.add_argument(
        "--restart_generation",
        type=int,
        default=0,
        help="restart a failed generation process (it rejoins the run), at most this many times",
    )
    parser.add_argument(
        "--restart_scoring",
        type=int,
        default=0,
        help="restart a failed scoring process (it rejoins the run), at most this many times",
    )
    parser.add_argument("--restart_delay_s", type=float, default=2.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    return parser


def parse_program(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """The flags and the command; a usage error (exit status 2) for impossible counts."""
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    n, g, s = args.num_processes, args.generation_processes, args.scoring_processes
    if n < 2 or s < 0 or not 1 <= g <= n - 1 - s:
        parser.error(
            f"need num_processes >= 2, scoring_processes >= 0 and 1 <= generation_processes "
            f"<= num_processes - scoring_processes - 1 = {n - 1 - s} (a training process)"
        )
    return args, command


def main(argv: list[str] | None = None) -> int:
    parser = program_parser(__doc__, "[pid, role]")
    parser.add_argument("--pin", action="store_true", help="taskset each child to one core")
    args, command = parse_program(parser, argv)
    n, g, s = args.num_processes, args.generation_processes, args.scoring_processes
    if args.pin and shutil.which("taskset") is None:
        parser.error("--pin needs taskset (util-linux)")
    cpus = sorted(os.sched_getaffinity(0))
    commands = [
        ["taskset", "-c", str(cpus[i % len(cpus)]), *command] if args.pin else list(command)
        for i in range(n)
    ]
    return supervise(
        commands,
        g,
        prefixes=[f"[p{i} {role_name(i, n, g, s)}] " for i in range(n)],
        grace_s=args.grace_s,
        timeout_s=args.timeout_s,
        restart_generation=args.restart_generation,
        restart_delay_s=args.restart_delay_s,
        scoring=s,
        restart_scoring=args.restart_scoring,
        pids_file=args.pids_file,
        port=args.port,
    )


if __name__ == "__main__":
    sys.exit(main())
