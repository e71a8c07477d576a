"""The ``kvstate`` command line: ``simulate``, ``plan``, ``scenario``, ``demo`` and ``diagram``.

Bad input (an option, a scenario, a path) is one line on stderr and exit 2, checked before
anything runs; see :data:`EXIT_CODES`.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .. import __version__
from .._errors import ConfigError, KVStateError
from ..sim._gpus import GPUS
from ..sim._scenario import MODES
from . import _arenacmd as arenacmd
from . import _democmd as democmd
from . import _profilecmd as profilecmd
from . import _simcmds as simcmds
from ._argtypes import NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, number

__all__ = ["main", "EXIT_CODES"]

#: What the exit status means (``kvstate --help`` and the README print this).
EXIT_CODES = {
    0: "success (plan: a configuration meets the SLOs)",
    1: "plan: no configuration meets the SLOs; demo: a byte differed or a block leaked",
    2: "bad input: an option, a scenario or trace file, an output path",
    3: "simulate: the run did not drain (a deadlock, or its time limit passed)",
    4: "plan: a configuration at most as cheap as any that meets the SLOs was too short to judge",
    130: "interrupted (Ctrl-C); plan keeps the rows so far in its --out file, if given",
    141: "stdout was closed early (e.g. piped into head)",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``kvstate CMD: error: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _overrides(p: argparse.ArgumentParser) -> None:
    """The scenario options ``simulate`` and ``plan`` share."""
    p.add_argument("scenario", nargs="?", metavar="SCENARIO",
                   help="a scenario TOML file or a preset name (`kvstate scenario --list`); default: the embedded one")
    g = p.add_argument_group("scenario overrides (applied in this order, --set last)")
    g.add_argument("--trace", help="replay this Mooncake-format JSONL trace instead of the scenario's arrivals")
    g.add_argument("--model", metavar="NAME_OR_CONFIG",
                   help="a model preset (llama-3-8b, llama-3-70b, ...) or a Hugging Face config.json")
    g.add_argument("--gpu", metavar="NAME", help=f"a GPU preset's datasheet and link figures ({', '.join(GPUS)})")
    g.add_argument("--mode", choices=MODES, help="pd: separate prefill and decode instances; colocated: both on "
                   "each instance ([scheduler], cluster.n_instances)")
    g.add_argument("--rate", type=POSITIVE_FLOAT, help="request rate, per second")
    g.add_argument("--num-prompts", type=POSITIVE_INT, help="number of requests")
    g.add_argument("--tp", type=POSITIVE_INT, help="tensor-parallel GPUs per instance")
    g.add_argument("--n-prefill", type=POSITIVE_INT, help="prefill instances")
    g.add_argument("--n-decode", type=POSITIVE_INT, help="decode instances")
    g.add_argument("--n-instances", type=POSITIVE_INT, help="co-located instances (--mode colocated)")
    g.add_argument("--seed", type=NON_NEGATIVE_INT, help="random seed (>= 0)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="the SLOs as vllm bench serve spells them: any "
                   "of ttft:MS tpot:MS e2el:MS; a request is good when it meets every one given (the others are off)")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any scenario field, e.g. --set slo.ttft_ms=500 (repeatable; VALUE is JSON or text)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def _parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {k:>3}  {v}" for k, v in EXIT_CODES.items())
    p = _Parser(prog="kvstate", description="The KV-cache life of PD-disaggregated LLM serving: simulate a "
                "cluster, plan capacity, run the demo.", epilog=f"exit status:\n{codes}",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvstate {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="COMMAND")
    s = sub.add_parser("simulate", help="simulate a PD cluster under a workload (the production machines, SimPy)")
    _overrides(s)
    s.add_argument("--json", action="store_true", help="print every metric as one JSON object")
    s.add_argument("--percentile-metrics", metavar="M,M", help="report percentiles of these, as vllm bench serve: "
                   "any of ttft,tpot,itl,e2el (default with --metric-percentiles: ttft,tpot,itl)")
    s.add_argument("--metric-percentiles", metavar="Q,Q", help="the percentiles to report, as vllm bench serve: "
                   "numbers in (0, 100] (default with --percentile-metrics: 99)")
    s.add_argument("--plot", metavar="DIR", help="write PNG charts (latency CDFs, utilisation) into DIR")
    s.add_argument("--timeline", metavar="FILE", help="write every request's states, transfers and steps as a "
                   "Chrome trace (Perfetto, chrome://tracing) to FILE (PD runs)")
    pl = sub.add_parser("plan", help="sweep scenario fields; find the cheapest configuration meeting the SLOs")
    _overrides(pl)
    pl.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2",
                    help="a field and its values, e.g. cluster.n_decode=1,2,4 (repeatable; each field once); "
                         "default: cluster.n_prefill and cluster.n_decode 1..4")
    pl.add_argument("--attainment", type=number(float, 0, False, "a number in (0, 1]"),
                    help="share of requests that must meet each SLO (default: the scenario's)")
    pl.add_argument("--workers", type=POSITIVE_INT, help="parallel simulations (default: every core)")
    pl.add_argument("--ray", metavar="ADDRESS", help="run the configurations as tasks on a Ray cluster: 'auto' "
                    "(the one this machine runs), HOST:PORT or ray://HOST:PORT (needs the ray extra; results "
                    "are the same as with local processes)")
    pl.add_argument("--out", metavar="FILE", help="write the JSON result to FILE, rewritten as rows come (none "
                    "without it)")
    pl.add_argument("--search-rate", action="store_true", help="also find, for each configuration, the highest "
                    "arrival rate at which it still meets the SLOs (a bisection on the rate, to within 5 %%)")
    pl.add_argument("--plot", metavar="DIR", help="write plan.png (every configuration) into DIR")
    pl.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    sc = sub.add_parser("scenario", help="print the default scenario, or a preset, as commented TOML")
    sc.add_argument("name", nargs="?", default="default", help="a preset (default: the embedded default)")
    sc.add_argument("--list", action="store_true", help="list the presets")
    democmd.add_parser(sub)
    profilecmd.add_parser(sub)
    arenacmd.add_parser(sub)
    g = sub.add_parser("diagram", help="print each lifecycle machine's diagram (mermaid), drawn from the machines")
    g.add_argument("--machine", choices=("prefill", "decode"), help="only this machine")
    return p


def _diagram(args: argparse.Namespace) -> int:
    from .. import MACHINES
    from .._machine import mermaid

    names = [args.machine] if args.machine else list(MACHINES)
    print("\n\n".join(f"```mermaid\n{mermaid(MACHINES[n]).rstrip()}\n```" for n in names))
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": simcmds.simulate, "plan": simcmds.plan, "scenario": simcmds.scenario,
    "demo": democmd.run, "diagram": _diagram, "profile": profilecmd.run, "arena": arenacmd.run,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (:data:`EXIT_CODES`)."""
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.cmd](args)
    except KVStateError as e:
        print(f"kvstate {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except simcmds.Interrupted as e:
        print(f"kvstate {args.cmd}: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"kvstate {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`kvstate diagram | head -1`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141
    except OSError as e:  # an output that could not be written after all (disk full, ...)
        raise SystemExit(f"kvstate {args.cmd}: error: {ConfigError(str(e))}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
