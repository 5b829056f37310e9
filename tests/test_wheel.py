"""draftsmith installed as a wheel, outside its checkout: built with the standard build tool,
installed into a fresh virtual environment in a temporary folder, run from there."""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_the_wheel_works_outside_the_checkout(tmp_path):
    p = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(REPO)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("draftsmith-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    # its dependencies from this environment (a path line in a .pth file: no package of it, draftsmith's
    # editable install included, comes before the wheel's own files)
    target_site = Path(subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    (target_site / "zz-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DRAFTSMITH_VLLM_VENV")}
    env["OMP_NUM_THREADS"] = "1"

    def run(*args, timeout=600):
        r = subprocess.run([str(venv / "bin" / "draftsmith"), *args], cwd=work, env=env, capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, f"{args}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        return r

    where = subprocess.run([str(py), "-c", "import draftsmith, draftsmith.vllm_server as v; print(draftsmith.__file__); "
                            "print(v.vllm_venv()); print(v.SETUP_SCRIPT.is_file())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(target_site))  # the wheel's copy, not the checkout
    assert not where[1].startswith(str(REPO)) and where[1].endswith("venv-vllm") and where[2] == "True"

    assert "estimate" in run("--help").stdout
    recipe = subprocess.run([str(py), "-c", "from draftsmith.demo import demo_recipe_text; print(demo_recipe_text())"],
                            cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    (work / "demo.yaml").write_text(recipe)
    (work / "llama.json").write_text((REPO / "configs" / "targets" / "llama-3.1-8b-instruct.json").read_text())
    e = json.loads(run("estimate", "demo.yaml", "--hardware", "h100", "--target-config", "llama.json", "--json").stdout)
    assert e["stages"]
    run("run", "demo.yaml", "--run", "r", "--until", "prepare", "--set", "generate.limit=3", "--set", "generate.max_tokens=8")
    assert (work / "r" / "prepare" / "manifest.json").is_file()
