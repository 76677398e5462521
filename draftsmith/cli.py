"""The one command line: `python -m draftsmith <command> ...` (or the `draftsmith` script).

Every rule and every process a stage spawns calls a command named here, never a module path,
so moving a module inside the package changes no rule's shell command. Each command is the
`main()` of one module, imported only when that command runs (a command's imports stay its
own: `draftsmith config-doc` does not load torch).
"""

from __future__ import annotations

import importlib
import sys

# command -> (module under draftsmith., what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("stages.env", "check a role's environment against its pins, or build its venv"),
    "target": ("targets.model", "fetch or build the target checkpoint and its fingerprint"),
    "tiny-model": ("targets.tinymodel", "write a tiny random-weight target of a given family"),
    "prompts": ("data.prompts", "read and validate the prompt sources into one prompt table"),
    "regenerate": ("stages.regenerate", "regenerate a row range's replies with the target"),
    "tokens": ("data.tokens", "tokenize a row range under the chat template, with its loss mask"),
    "vocab": ("data.vocab", "count token frequencies and write the draft vocabulary map"),
    "sglang-patch": ("engines.sglang.patch", "install and verify the patched SGLang"),
    "plan": ("hidden.plan", "plan capture: shard sizes, disk and memory, before any job"),
    "capture": ("stages.capture", "capture one shard's hidden states from the target"),
    "shards": ("hidden.shards", "verify or inspect hidden-state shards"),
    "segment-capture": ("stages.segcapture", "capture one segment (train past the disk)"),
    "segment-train": ("stages.segtrain", "train on one segment, then delete it, or export"),
    "train": ("train.launch", "train the draft: launches one process per rank"),
    "train-rank": ("stages.train", "one training rank (spawned by `train`)"),
    "export": ("algorithms.export", "export a trained draft for the engines, or check one"),
    "bench": ("stages.bench", "measure acceptance on held-out prompts and write the report"),
    "captions": ("bench.captions", "write the report's figure captions"),
    "convert": ("interop.convert", "convert drafts and data from and to SpecForge, speculators"),
    "config-doc": ("config.doc", "write or check docs/config.md from the schema"),
    "shared-server": ("engines.sharedserver", "host one engine server for a whole run"),
    "sglang-selfcheck": ("engines.sglang.cpu.selfcheck", "check SGLang's CPU layer loads"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: draftsmith <command> [args ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`draftsmith <command> --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name in ("-V", "--version"):
        from draftsmith import __version__

        print(f"draftsmith {__version__}")
        return
    if name not in COMMANDS:
        sys.exit(f"draftsmith: unknown command {name!r}\n\n{usage()}")
    module = importlib.import_module(f"draftsmith.{COMMANDS[name][0]}")
    sys.argv = [f"draftsmith {name}", *rest]
    try:
        result = module.main()
    except Exception as e:
        # an error that knows its one-line form (a server that could not start or kept dying,
        # draftsmith.engines.server.ServerError): its details, then that line, last in the log
        if not callable(getattr(e, "one_line", None)):
            raise
        print(f"draftsmith {name}: {e}", file=sys.stderr)
        sys.exit(f"draftsmith {name}: error: {e.one_line()}")
    if isinstance(result, int) and result:
        sys.exit(result)
