"""The ``spike-course`` command: lab, doctor, exercises, run, grade, html, run-times, workers, gpu-check.

    spike-course lab [--ip 127.0.0.1] [--port 8888]   JupyterLab on the course, token on
    spike-course doctor                               what this machine can do for the course
    spike-course exercises [--check] [--force]        write exercises/ from solutions/, keeping your work
    spike-course run NOTEBOOK [-o OUT]                execute a notebook headless, keep the copy
    spike-course html [--out _build/html]             the rendered edition, a Sphinx site
    spike-course run-times [--check]                  the README's run times, from notebooks/run_times.json
    spike-course grade NOTEBOOK...                    run learners' exercise notebooks' checks
    spike-course workers [--out DIR] [--from exercises/]  worker scripts for torchrun on a node
    spike-course gpu-check [NAME...] [--placement auto|per-gpu|shared]  run lectures and solutions here, tabulate
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT_MARKERS = ("pyproject.toml", "notebooks")


def course_root() -> Path:
    """The course checkout: the current folder or the one above it holding notebooks/."""
    here = Path.cwd()
    for folder in (here, *here.parents):
        if all((folder / marker).exists() for marker in ROOT_MARKERS):
            return folder
    return here


def cmd_lab(args) -> int:
    root = course_root()
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.ip={args.ip}",
               f"--ServerApp.port={args.port}", f"--ServerApp.root_dir={root}",
               f"--ServerApp.open_browser={not args.no_browser}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # containers (a Run:ai pod, CI) often run as root
    if args.token:  # otherwise JupyterLab makes a random token and prints the URL with it
        command.append(f"--IdentityProvider.token={args.token}")
    if args.ip not in ("127.0.0.1", "localhost"):
        print(f"warning: JupyterLab will listen on {args.ip}, reachable from other machines; "
              "it still asks for its token", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="spike_course_lab_") as folder:  # gone when the lab ends
        shell = terminal_shell(os.environ.get("SHELL") or "/bin/sh", Path(folder))
        command.append("--ServerApp.terminado_settings=" + json.dumps({"shell_command": shell}))
        return subprocess.call(command, env=lab_environment(os.environ))


def environment_bin() -> str:
    """The folder of this environment's python, torchrun and spike-course."""
    return str(Path(sys.executable).parent)


def lab_environment(environ) -> dict:
    """JupyterLab's environment, which its kernels and terminals inherit: this environment's
    programs first on PATH, as after `source .venv/bin/activate`."""
    env = dict(environ)
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != environment_bin()]
    env["PATH"] = os.pathsep.join([environment_bin(), *rest])
    if Path(sys.prefix, "pyvenv.cfg").exists():
        env["VIRTUAL_ENV"] = sys.prefix
    return env


def terminal_shell(shell: str, folder: Path) -> list[str]:
    """The command of a JupyterLab terminal. Left alone, JupyterLab starts a login shell when
    it has no terminal of its own, and /etc/profile then resets PATH; a ~/.bashrc may put
    other Pythons first. So bash reads its usual ~/.bashrc and then this environment's bin,
    last (from a file written in ``folder``, which must outlive the lab); another shell
    starts as it is, with PATH from lab_environment."""
    if Path(shell).name != "bash":
        return [shell]
    rc = folder / "bashrc"
    rc.write_text('[ -f ~/.bashrc ] && . ~/.bashrc\n'
                  f'export PATH={shlex.quote(environment_bin())}:"$PATH"\n')
    return [shell, "--rcfile", str(rc)]


def doctor_lines() -> tuple[list[str], list[str], list[str]]:
    """(what this machine offers the course, one line each; the problems that stop a chapter;
    notes on what works differently from what the chapters say)."""
    import shutil

    import torch
    import torch.distributed as dist

    from .data import data_source
    from .notebook import describe_devices

    problems, notes = [], []
    lines = [f"python            {platform.python_version()} ({sys.executable})",
             f"machine           {describe_devices()}",
             f"cuda build        {torch.version.cuda or 'none (a CPU-only torch)'}"]
    if not dist.is_gloo_available():
        problems.append("torch has no gloo backend: reinstall torch 2.14.1 from PyPI")
    lines.append(f"gloo              {'available' if dist.is_gloo_available() else 'MISSING'}")
    lines.append(f"nccl              {'available' if dist.is_nccl_available() else 'not available'}"
                 + ("" if torch.cuda.is_available() else " (needs CUDA GPUs anyway)"))
    lines.append(f"data              {data_source()}")
    torchrun, ours = shutil.which("torchrun"), str(Path(environment_bin()) / "torchrun")
    lines.append(f"torchrun          {torchrun or 'not on PATH'}")
    if torchrun != ours:  # the notebooks still run: launch starts python -m torch.distributed.run
        notes.append(f"this shell's torchrun is {torchrun or 'missing'}, not the course's {ours}: "
                        f"activate the course's environment (source {Path(environment_bin()) / 'activate'}), "
                        "or open the terminal from `make lab` (chapters 07 and 17 type torchrun there)")
    for module, what in (("jupyterlab", "jupyterlab"), ("ipywidgets", "ipywidgets"),
                         ("jupyterlab_widgets", "widgets extension")):
        found = importlib.util.find_spec(module) is not None
        version = ""
        if found:
            try:
                version = " " + __import__(module).__version__
            except Exception:  # a module without __version__ is still installed
                pass
        else:
            problems.append(f"{what} is missing: pip install {module}")
        lines.append(f"{what:<17} {'installed' + version if found else 'MISSING: pip install ' + module}")
    return lines, problems, notes


def doctor_report() -> tuple[str, bool]:
    """What `spike-course doctor` prints, ending with its verdict; and whether it is ready."""
    lines, problems, notes = doctor_lines()
    if problems:
        lines.append("NOT READY:\n" + "\n".join(f"  - {problem}" for problem in problems))
    else:
        lines.append("ready: every chapter runs here (its workers use gloo on the CPU, or NCCL on GPUs as above)")
    lines += [f"note: {note}" for note in notes]
    return "\n".join(lines), not problems


def cmd_doctor(args) -> int:
    report, ready = doctor_report()
    print(report)
    return 0 if ready else 1


def cmd_exercises(args) -> int:
    from .course import exercises

    root = course_root()
    solutions, target = root / "solutions", root / "exercises"
    if args.check:
        lines, in_sync = exercises.check(solutions, target)
        for line in lines:
            print(line)
        if not in_sync:
            print("The course part of exercises/ differs from solutions/. `spike-course exercises` "
                  "rewrites what holds no work of yours and names what it keeps.")
        return 0 if in_sync else 1
    done = exercises.generate(solutions, target, force=args.force)
    for path, what in done.items():
        if what != "up to date":
            print(f"{path.relative_to(root)}: {what}")
    kept = [path for path, what in done.items() if what.startswith("kept")]
    if kept:
        print(f"{len(kept)} notebook(s) kept as they are: they hold your work. To replace them with "
              "the blank exercise anyway, run `spike-course exercises --force`: each is first "
              "copied to exercises/backups/.")
        return 1
    return 0


def cmd_run(args) -> int:
    import nbformat

    from .lab.headless import run_notebook

    path = Path(args.notebook)
    if not path.is_file():
        print(f"no notebook at {path}", file=sys.stderr)
        return 2
    # Not beside the notebook: nbval and the notebook tests would collect the executed copy.
    out = Path(args.output) if args.output else Path("_build", "executed", path.parent.name, path.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = run_notebook(path, timeout=args.timeout)
    if run.error:  # the executed copy still shows where it stopped
        print(f"{path}: {run.error}", file=sys.stderr)
    nbformat.write(run.notebook, out)
    print(f"wrote {out} ({run.seconds:.0f} s)")
    return 1 if run.error else 0


def cmd_grade(args) -> int:
    import nbformat

    from .course.grading import check_name, grade

    failed = 0
    for name in args.notebooks:
        report = grade(name, timeout=args.timeout, solutions_dir=course_root() / "solutions")
        checks = [entry for entry in report if entry.get("name") != "grading"]
        problems = [entry for entry in report if entry.get("name") == "grading"]
        cells = len(nbformat.read(name, as_version=4).cells)
        passed = sum(check["error"] is None for check in checks)
        print(f"{name}: {passed} of {len(checks)} checks pass"
              + (f", and {len(problems)} grading problem(s)" if problems else ""))
        for entry in checks + problems:
            # Numbered as JupyterLab's status bar shows the cell: "Cell 12/12".
            where = "a deleted cell" if entry["index"] is None else f"cell {entry['index'] + 1}/{cells}"
            state = "pass" if entry["error"] is None else "FAIL"
            line = f"  {state}  {where}, {entry.get('name') or check_name(entry['source'])}"
            print(line + (f": {entry['error'].strip()[:500]}" if entry["error"] else ""))
        failed += passed < len(checks) or not checks or bool(problems)
    return 1 if failed else 0


def cmd_html(args) -> int:
    from .course.edition import build_site

    root = course_root()
    # The executed notebooks' cache stays with the course, wherever the site goes.
    failed = build_site(root / "notebooks", Path(args.out).resolve(), root / "_build" / "edition", args.timeout)
    return 1 if failed else 0


def cmd_run_times(args) -> int:
    from .course import run_times

    root = course_root()
    readme, data = root / "README.md", run_times.load(root / run_times.FILE)
    if args.check:
        problems = run_times.disagreements(readme.read_text(), data)
        print("\n".join(problems) or f"README.md states the run times of {run_times.FILE}")
        return 1 if problems else 0
    text, unknown = run_times.rewrite(readme.read_text(), data)
    readme.write_text(text)
    print(f"README.md: run times written from {run_times.FILE}"
          + (f"; measured by nothing yet: {', '.join(unknown)}" if unknown else ""))
    return 1 if unknown else 0


def cmd_workers(args) -> int:
    from .course.workers import export, unanswered

    out, root = Path(args.out).resolve(), course_root()
    if not (root / "notebooks").is_dir() and not args.sources:
        print(f"no notebooks/ in {root} or above: run this inside the course checkout, or name the "
              "notebooks with --from", file=sys.stderr)
        return 2
    try:
        written = export(root, out, args.sources)
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        return 2
    for path in written:
        print(path.relative_to(out))
    print(f"wrote {len(written)} worker scripts to {out}, and README.md on how to run them on a node; "
          "each file's first line says how to run it (cd there first)")
    blank = unanswered(written)
    if blank:
        print("still the exercise's blank (they raise NotImplementedError): "
              + ", ".join(str(path.relative_to(out)) for path in blank))
    return 0


def cmd_gpu_check(args) -> int:
    from .gpu_check import execute, gpu_count, notebooks, placements, result, table
    from .notebook import describe_devices

    paths = notebooks(course_root(), args.names)
    if not paths:
        print(f"no lecture or solution matches {args.names}", file=sys.stderr)
        return 2
    try:
        runs = placements(args.placement, gpu_count())
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    machine = describe_devices()
    print(f"machine: {machine}; placements: {', '.join(runs)}", flush=True)
    rows = []
    for path in paths:
        for placement in runs:
            rows.append(execute(path, timeout=args.timeout, placement=placement))
            row = rows[-1]
            print(f"{row['notebook']} ({placement}): {result(row)} in {row['seconds']:.0f} s, "
                  f"ranks used {row['backend']} on {row['device']}", flush=True)
    print(table(rows, machine))
    return 0 if all(row["ok"] for row in rows) else 1


def cmd_rehearse(args) -> int:
    from . import rehearsal

    text = Path(args.job).read_text() if Path(args.job).is_file() else args.job
    try:
        readings = {flavour: rehearsal.read(text, flavour) for flavour in ("older", "newer")}
    except ValueError as error:
        print(f"cannot read the job: {error}", file=sys.stderr)
        return 2
    other = "newer" if args.flavour == "older" else "older"
    print(f"-- under the {other} operator (read, not run)")
    print(rehearsal.line_report(readings[other]))
    print(f"-- under the {args.flavour} operator")
    run = rehearsal.rehearse(text, volume=args.volume, flavour=args.flavour, preempt_at=args.preempt_at,
                             timeout=args.timeout, gpus_per_pod=args.gpus_per_pod, keep=args.keep)
    print(rehearsal.run_report(run))
    if run.folder is not None:
        print(f"kept: {run.folder} (each pod's output is <pod>.log there)")
    names = rehearsal.mistakes(readings[other]) + rehearsal.mistakes(run)
    return 1 if names else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spike-course", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lab = commands.add_parser("lab", help="start JupyterLab on the course")
    lab.add_argument("--ip", default="127.0.0.1", help="address to listen on (default: localhost only)")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--token", default=None, help="fixed token (default: JupyterLab makes one)")
    lab.add_argument("--no-browser", action="store_true")
    lab.set_defaults(func=cmd_lab)
    commands.add_parser("doctor", help="check this machine for the course").set_defaults(func=cmd_doctor)
    exercises = commands.add_parser("exercises", help="write exercises/ from solutions/")
    exercises.add_argument("--check", action="store_true",
                           help="only check that the course part is in sync (your answers are fine)")
    exercises.add_argument("--force", action="store_true",
                           help="replace notebooks that hold your work too (copied to exercises/backups/ first)")
    exercises.set_defaults(func=cmd_exercises)
    run = commands.add_parser("run", help="execute a notebook headless and write the executed copy")
    run.add_argument("notebook")
    run.add_argument("-o", "--output", help="where to write it (default: _build/executed/FOLDER/NAME.ipynb)")
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    run.set_defaults(func=cmd_run)
    grade_ = commands.add_parser("grade", help="run the check cells of exercise notebooks")
    grade_.add_argument("notebooks", nargs="+")
    grade_.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    grade_.set_defaults(func=cmd_grade)
    html = commands.add_parser("html", help="execute the lectures and write a static HTML edition")
    html.add_argument("--out", default="_build/html")
    html.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    html.set_defaults(func=cmd_html)
    times = commands.add_parser("run-times", help="write the README's run times from notebooks/run_times.json")
    times.add_argument("--check", action="store_true", help="only say where the README disagrees with the file")
    times.set_defaults(func=cmd_run_times)
    workers = commands.add_parser("workers", help="write every chapter's worker scripts to a folder")
    workers.add_argument("--out", default="cluster_workers")
    workers.add_argument("--from", dest="sources", nargs="+", metavar="NOTEBOOK_OR_FOLDER",
                         help="export these notebooks (e.g. exercises/, your answers) instead of "
                              "the lectures and solutions")
    workers.set_defaults(func=cmd_workers)
    gpu = commands.add_parser("gpu-check", help="run lectures and solutions, print a pass/fail table")
    gpu.add_argument("names", nargs="*", help="only notebooks whose path contains one of these")
    gpu.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    gpu.add_argument("--placement", choices=("auto", "per-gpu", "shared"), default="auto",
                     help="per-gpu: every GPU visible, a rank per GPU; shared: one GPU, which the ranks "
                          "share; auto (default): both, when there are 2 GPUs or more")
    gpu.set_defaults(func=cmd_gpu_check)
    rehearse = commands.add_parser(
        "rehearse", help="run a runai line (or torchrun command) here as the cluster would")
    rehearse.add_argument("job", help="the line, in quotes, or a file holding it")
    rehearse.add_argument("--volume", help="a folder that stands for the job's persistent volume "
                                           "(copied: the job never writes to it)")
    rehearse.add_argument("--flavour", choices=("older", "newer"), default="older",
                          help="which training-operator release runs it (the other is read too)")
    rehearse.add_argument("--preempt-at", type=float, metavar="SECONDS",
                          help="SIGTERM to every pod then, SIGKILL after the line's grace period")
    rehearse.add_argument("--timeout", type=float, default=120.0, help="seconds before the job is killed")
    rehearse.add_argument("--gpus-per-pod", type=float, metavar="N",
                          help="ranks that --nproc-per-node=gpu starts per pod here (default: the GPUs "
                               "the line asks for; fewer keeps a laptop responsive)")
    rehearse.add_argument("--keep", action="store_true", help="keep the run's folder (logs, volume copy)")
    rehearse.set_defaults(func=cmd_rehearse)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
