"""`python -m build` makes a wheel and an sdist; the wheel, installed (not editable) into a new
virtual environment, puts one top-level import name into site-packages, `tokenmill`, with its
package data, and runs a job through `tokenmill run-batch`.

The new environment reads the project environment's third-party packages through a path file
(so the test does not download PyTorch again), but not its editable install of tokenmill: path
files in a folder reached that way are not processed, so only the wheel provides `tokenmill`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONSAFEPATH="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=600, cwd=out, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels, sdists = list(out.glob("tokenmill-*.whl")), list(out.glob("tokenmill-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_package_with_its_data(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"tokenmill"}
    for needed in ("tokenmill/cli/__init__.py", "tokenmill/engine/engine.py", "tokenmill/schemas/job.py",
                   "tokenmill/kernels/paged_attention.py", "tokenmill/tools/bench.py",
                   "tokenmill/schemas/json/job.schema.json", "tokenmill/eval/tasks/",
                   "tokenmill/kernels/cpu/paths.py", "tokenmill/kernels/cpu/csrc/amx_tiles.h"):
        assert any(name.startswith(needed) for name in names), needed
    # Every C source of the CPU kernels: the engine compiles them on the machine it runs on.
    from tokenmill.kernels.cpu.build import CSRC

    sources = {f"tokenmill/kernels/cpu/csrc/{p.name}" for p in CSRC.iterdir() if p.suffix in (".c", ".h")}
    assert len(sources) >= 7 and sources <= set(names), sorted(sources - set(names))
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tokenmill = tokenmill.cli:main" in zipfile.ZipFile(built["wheel"]).read(entry).decode()


@pytest.mark.slow
def test_the_wheel_installed_into_a_new_environment_runs_a_job(built, tiny_llama_dir, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", str(built["wheel"])], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    installed = {p.name for p in purelib.iterdir()} - {"project-dependencies.pth", "__pycache__"}
    assert {n for n in installed if not n.endswith(".dist-info")} == {"tokenmill"}

    where = subprocess.run([str(python), "-c", "import tokenmill, tokenmill.kernels; print(tokenmill.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=_clean_env(), timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(purelib)

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"job_id": "w-1", "prompt_token_ids": [5, 6, 7, 8],
                                "sampling": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}}) + "\n")
    out = tmp_path / "out.jsonl"
    run = subprocess.run([str(venv / "bin" / "tokenmill"), "run-batch", "--model", str(tiny_llama_dir),
                          "--kv-cache-gb", "0.05", str(jobs), str(out)],
                         capture_output=True, text=True, cwd=tmp_path, env=_clean_env(), timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text().splitlines()[0])
    assert result["job_id"] == "w-1" and result["status"] == "ok" and len(result["token_ids"]) == 4
