"""scripts/run.sh as a user runs it: which stage gets which argument, and what it does when the SFT stage stops
early. The script runs in a copy of the repository whose set-up is done and whose torchrun is a stand-in that
records its arguments (the stages themselves are tested through the entry points elsewhere)."""

import json
import os
import shutil
import subprocess
import sys

from tests.conftest import REPO

FAKE_TORCHRUN = """#!/bin/bash
# Records its arguments one a line; as trainer.sft, exports outputs/sft/hf unless FAKE_SFT_STOPS is set (a stop on
# a signal: exit 0 after saving, no export).
printf '%s\\n' "$@" "--" >> "$FAKE_CALLS"
if [[ " $* " == *" trainer.sft "* && -z "${FAKE_SFT_STOPS:-}" ]]; then
  mkdir -p outputs/sft/hf && echo '{}' > outputs/sft/hf/config.json
fi
exit "${FAKE_STATUS:-0}"
"""


def run_script(tmp_path, *arguments, **env):
    """scripts/run.sh of a copy of the repository with a stand-in torchrun, from another directory; the result and
    each stage's arguments after `--resume-from-checkpoint latest`, keyed by entry point."""
    repo = tmp_path / "my repo"
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "run.sh", repo / "scripts" / "run.sh")
    (repo / "scripts" / "setup.sh").write_text("#!/bin/bash\n")
    (repo / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    for name, text in (("scripts/setup.sh", "#!/bin/bash\n"), (".venv/bin/torchrun", FAKE_TORCHRUN)):
        (repo / name).write_text(text)
        (repo / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    shutil.rmtree(repo / "outputs", ignore_errors=True)
    result = subprocess.run([str(repo / "scripts" / "run.sh"), *arguments], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "FAKE_CALLS": str(calls), **env})
    stages = {}
    for call in calls.read_text().split("--\n")[:-1] if calls.exists() else []:
        words = call.splitlines()
        stages[words[words.index("-m") + 1]] = words[words.index("latest") + 1:]
    return result, stages


def test_run_script_starts_grpo_from_its_sft_and_gives_grpo_keys_to_grpo_only(tmp_path):
    # `--model.path` is the SFT's starting model: GRPO went to it too and started from the untrained model, leaving
    # the SFT's export unused; a `--grpo.*` key stopped the SFT stage with "Unknown config key".
    result, stages = run_script(tmp_path, "--model.path=/models/base", "--train.steps", "20", "--grpo.n_samples", "4",
                                "--grpo.kl_coef=0.1")
    assert result.returncode == 0, result.stderr
    assert stages == {
        "trainer.sft": ["--model.path=/models/base", "--train.steps", "20"],
        "trainer.grpo": ["--model.path=/models/base", "--train.steps", "20", "--grpo.n_samples", "4",
                         "--grpo.kl_coef=0.1", "--model.path=outputs/sft/hf"]}
    result, stages = run_script(tmp_path)
    assert result.returncode == 0 and stages == {"trainer.sft": [], "trainer.grpo": ["--model.path=outputs/sft/hf"]}


def test_run_script_stops_after_an_sft_stopped_early_and_passes_failures_on(tmp_path):
    # An SFT stopped on a signal (exit 0, checkpoint saved, no export): GRPO started and ran the default SFT's own
    # settings on that checkpoint (`--train.steps=30` stopped at step 4: "saved with train.steps=30 and this run has
    # train.steps=600", exit 1).
    result, stages = run_script(tmp_path, "--train.steps=30", FAKE_SFT_STOPS="1")
    assert result.returncode == 0 and list(stages) == ["trainer.sft"], result.stderr
    assert "the SFT stopped before its last step" in result.stderr and "with the same arguments" in result.stderr
    result, stages = run_script(tmp_path, FAKE_STATUS="3")
    assert result.returncode == 3 and list(stages) == ["trainer.sft"]
    # One output directory for both stages is refused before anything runs.
    for arguments in (["--train.out_dir=/tmp/x"], ["--ckpt.dir", "/tmp/x"]):
        result, stages = run_script(tmp_path, *arguments)
        assert result.returncode == 2 and stages == {} and result.stderr.startswith("error: scripts/run.sh writes")


def test_setup_script_repairs_a_damaged_environment_and_is_quick_when_synced(tmp_path):
    """scripts/setup.sh on a project of one locked package (offline, from uv's cache, which set-up filled): a second
    run does nothing; after the package is removed from .venv it syncs again (it exited 0 at once, the stamp alone
    matching, and left the environment broken)."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    (project / "pyproject.toml").write_text('[project]\nname = "megatron-trainer"\nversion = "0.1.0"\n'
                                            'requires-python = "==3.12.*"\ndependencies = ["einops==0.8.2"]\n')
    venv_python = project / ".venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(project / ".venv")], check=True, timeout=60)
    shutil.copy(REPO / ".venv" / "bin" / "uv", project / ".venv" / "bin" / "uv")
    env = {**os.environ, "UV_OFFLINE": "1", "PYTHON312": sys.executable}
    # The lock: the repository's own einops entry (its wheel is in uv's cache after set-up), and the project.
    (einops_entry,) = [entry for entry in (REPO / "uv.lock").read_text().split("\n[[package]]\n")
                       if entry.startswith('name = "einops"\nversion = "0.8.2"\n')]
    (project / "uv.lock").write_text(
        'version = 1\nrevision = 5\nrequires-python = "==3.12.*"\n\n[[package]]\n' + einops_entry.strip() + "\n\n"
        '[[package]]\nname = "megatron-trainer"\nversion = "0.1.0"\nsource = { virtual = "." }\n'
        'dependencies = [\n    { name = "einops" },\n]\n\n'
        '[package.metadata]\nrequires-dist = [{ name = "einops", specifier = "==0.8.2" }]\n')

    def setup():
        result = subprocess.run([str(project / "scripts" / "setup.sh")], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stderr

    def einops() -> int:
        return subprocess.run([str(venv_python), "-c", "import einops"], capture_output=True, timeout=60).returncode

    assert "environment ready" in setup() and einops() == 0
    assert setup() == ""
    # A package the lock does not list (as `uv sync --extra te` installs Transformer Engine) is no damage: an exact
    # check re-synced at every start and uninstalled it.
    (site,) = (project / ".venv" / "lib").glob("python3.*/site-packages")
    (site / "extra_package.py").write_text("")
    (site / "extra_package-1.0.dist-info").mkdir()
    for name, text in (("METADATA", "Metadata-Version: 2.1\nName: extra-package\nVersion: 1.0\n"),
                       ("INSTALLER", "uv\n"), ("RECORD", "extra_package.py,,\n")):
        (site / "extra_package-1.0.dist-info" / name).write_text(text)
    assert setup() == "" and (site / "extra_package.py").exists()
    subprocess.run([str(project / ".venv" / "bin" / "uv"), "pip", "uninstall", "-q", "einops", "--python",
                    str(venv_python)], cwd=project, env=env, check=True, timeout=60)
    assert einops() == 1
    assert "environment ready" in setup() and einops() == 0
    assert setup() == ""


def test_plot_metrics_writes_the_png_it_names(tmp_path):
    """scripts/plot_metrics.py's `--out`: a folder takes metrics.png (matplotlib wrote `folder.png` beside it and the
    script said `wrote folder`), a missing parent is made (a FileNotFoundError traceback), a name not ending in .png is
    refused (`x.jpg`: a ValueError traceback; `pic`: pic.png written, `pic` named); a file of no rows is refused (an
    empty picture, "1 run: ")."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 6.0 / step, "lr": 1e-3}) + "\n"
                                               for step in range(1, 5)))
    (tmp_path / "folder").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")

    def plot(*arguments):
        return subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), *arguments], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    for out, written in (("folder", "folder/metrics.png"), ("new/dir/x.png", "new/dir/x.png")):
        result = plot("run", "--out", out)
        assert result.returncode == 0 and result.stdout.startswith(f"wrote {written} (1 run: training loss, "), result.stderr
        assert (tmp_path / written).read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "folder.png").exists()
    for out in ("x.jpg", "pic"):
        result = plot("run", "--out", out)
        assert result.returncode == 2 and f"--out {out}: the picture is a PNG" in result.stderr, result.stderr
        assert not any(tmp_path.glob(f"{out}*"))
    result = plot("empty")
    assert result.returncode == 2 and "metrics.jsonl in empty holds no rows" in result.stderr


def test_slurm_script_keeps_a_first_starts_own_checkpoint_to_resume(tmp_path):
    """scripts/slurm/train.sbatch under stand-ins for srun, scontrol and torchrun (which prints its arguments): a
    job's `--resume-from-checkpoint X` was followed by the script's `latest`, which the trainer takes (the last one
    given): the job trained from scratch into its new output directory instead of from X. Its first start now
    keeps X; a requeued start resumes its own latest checkpoint."""
    bin_dir, trainer = tmp_path / "bin", tmp_path / "trainer"
    (trainer / ".venv" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    for path, text in ((bin_dir / "srun", '#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n'),
                       (bin_dir / "scontrol", '#!/bin/bash\n[ "$1" = show ] && echo 127.0.0.1\nexit 0\n'),
                       (trainer / ".venv" / "bin" / "torchrun", '#!/bin/bash\necho "torchrun $*"\n')):
        path.write_text(text)
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "n1", "TRAINER_DIR": str(trainer)}

    def launch(*arguments, **more):
        result = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "train.sbatch"), "-m", "trainer.sft", *arguments],
                                cwd=tmp_path, env={**env, **more}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        (line,) = [line for line in result.stdout.splitlines() if line.startswith("torchrun ")]
        return line[line.index("-m trainer.sft") + len("-m trainer.sft "):]

    for given in (["--resume-from-checkpoint=/runs/a/checkpoints/step_00000100"],
                  ["--resume-from-checkpoint", "/runs/a/checkpoints/step_00000100"]):
        assert launch(*given) == " ".join(given)
        assert launch(*given, SLURM_RESTART_COUNT="1") == " ".join(given) + " --resume-from-checkpoint latest"
    assert launch("--train.steps=5", OUT_DIR="/runs/b c") == "--train.steps=5 --train.out_dir=/runs/b c --resume-from-checkpoint latest"
