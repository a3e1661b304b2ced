"""transformers, peft and trl on accel, through its ``accelerate`` alias, beside Accelerate 1.15.

The ``hf-stack`` nox session installs accel, runs ``accel alias install`` (so the session's
``accelerate`` is accel, with no code change), installs peft and trl on top (their requirement
on ``accelerate`` is met by the alias, so pip pulls no Accelerate), and runs this file with
``ACCEL_REFERENCE_PYTHON`` naming Accelerate 1.15's own venv (``tools/reference_venv.py
--hf-stack``). The scripts in ``hf_stack/`` import only transformers, peft and trl; each runs on
both libraries and the results must agree:

- ``loading.py``: ``from_pretrained(device_map="auto" | dict, max_memory, offload_folder)`` with
  CPU and disk entries and ``pipeline(device_map="auto")``: the same device maps, logits and
  generated tokens (``torch.equal``); accel writes no offload file for a safetensors checkpoint.
- ``trainer.py``: ``Trainer`` on a tiny Llama (fp32, bf16) and a tiny BERT classifier (bf16),
  accumulation 4, evaluation, checkpoints, on 1 process and on 2 (``accelerate launch --cpu
  --num_processes 2``, the alias's command); losses equal and weights within 1e-6, and each
  library resumes from the other's checkpoint to the same weights as an uninterrupted run.
- ``extras.py``: peft LoRA through ``Trainer``, trl's ``SFTTrainer``, and
  ``Trainer(auto_find_batch_size=True)`` halving a batch that runs out of memory.
- ``engines.py``: ``Trainer`` with FSDP2 (full and sharded checkpoints) and DeepSpeed ZeRO-2 on
  2 CPU processes, with a resume. Accelerate 1.15 cannot run either on CPU processes (it drops
  them and trains DDP), so these are compared with a plain PyTorch oracle on the global batch.

Outside that session (no transformers, peft or trl) the file skips; with
``ACCEL_REQUIRE_HF_STACK=1`` (set by the session) a missing piece fails instead.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REQUIRED = os.environ.get("ACCEL_REQUIRE_HF_STACK") == "1"
for _name in ("transformers", "peft", "trl", "datasets"):
    if REQUIRED:
        importlib.import_module(_name)  # the session installed them: missing is a failure
    else:
        pytest.importorskip(_name)

from safetensors.torch import load_file  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "hf_stack"
REFERENCE = os.environ.get("ACCEL_REFERENCE_PYTHON", "")
TIMEOUT = 600
FP32 = 1e-6

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _environ(library: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    environ.update(
        {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    )
    if library == "accelerate":
        environ["ACCELERATE_USE_CPU"] = "1"  # its CPU launch flags start one process
    return environ


def run(library: str, processes: int, script: str, *args: str | Path) -> None:
    """Run a scenario script on ``library`` with ``processes`` processes; fail on its error."""
    if library == "accel":
        python = Path(sys.executable)
        launch = [str(python.parent / "accelerate"), "launch", "--cpu", "-q"]
    else:
        if not REFERENCE:
            pytest.fail("ACCEL_REFERENCE_PYTHON must name Accelerate 1.15's python")
        python = Path(REFERENCE)
        launch = [str(python.parent / "accelerate"), "launch", "--multi_gpu"]
    command = [str(python), str(SCRIPTS / script)]
    if processes > 1:
        command = [*launch, "--num_processes", str(processes), str(SCRIPTS / script)]
    done = subprocess.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_environ(library),
        cwd=SCRIPTS,
    )
    assert done.returncode == 0, (
        f"{library} {script} exited {done.returncode}; its stderr, then stdout:\n"
        f"{_without_progress_bars(done.stderr)[-8000:]}\n{done.stdout[-2000:]}"
    )


def _without_progress_bars(text: str) -> str:
    """``text`` without tqdm's lines (weights loaded, shards written), which would otherwise
    push a failing process's traceback out of the assertion message."""
    kept = (line for line in text.splitlines() if "it/s]" not in line and line.strip())
    return "\n".join(kept)


@functools.cache
def workspace() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="accel-hf-stack-"))


@functools.cache
def models() -> Path:
    folder = workspace() / "models"
    sys.path.insert(0, str(SCRIPTS))
    try:
        from common import tiny_classifier, tiny_llama

        tiny_llama(folder / "llama")
        tiny_classifier(folder / "bert")
    finally:
        sys.path.remove(str(SCRIPTS))
    return folder


def read(folder: Path, name: str) -> dict[str, Any]:
    return json.loads((folder / f"{name}.json").read_text())


def tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"{name}.safetensors"))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module", autouse=True)
def _clean_workspace() -> Any:
    yield
    shutil.rmtree(workspace(), ignore_errors=True)


# --- the alias, as pip and the stack see it ------------------------------------------------------


def test_the_environment_sees_accel_as_accelerate() -> None:
    import importlib.metadata

    import accelerate

    import accel

    assert accelerate.Accelerator is accel.Accelerator
    assert accelerate.__version__ == "1.15.0"
    version = importlib.metadata.version("accelerate")
    assert version == f"1.15.0+accel.{accel.__version__}"
    # peft and trl require accelerate: the alias met it, pip pulled no Accelerate
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
    env = subprocess.run(
        [str(Path(sys.executable).parent / "accel"), "env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "- `accelerate` alias: installed in" in env.stdout, env.stdout


# --- from_pretrained and pipeline --------------------------------------------------------------


@functools.cache
def loading() -> tuple[Path, Path]:
    ours, theirs = workspace() / "loading-accel", workspace() / "loading-accelerate"
    run("accel", 1, "loading.py", ours, models() / "llama")
    run("accelerate", 1, "loading.py", theirs, models() / "llama")
    return ours, theirs


def test_from_pretrained_and_pipeline_equal_accelerates() -> None:
    ours, theirs = loading()
    mine, reference = read(ours, "loading"), read(theirs, "loading")
    assert (mine.pop("library"), reference.pop("library")) == ("accel", "accelerate")
    assert mine == reference
    assert set(mine["auto.device_map"].values()) == {"cpu", "disk"}  # both tiers in use
    ours_t, theirs_t = tensors(ours, "loading"), tensors(theirs, "loading")
    assert ours_t.keys() == theirs_t.keys()
    for key in ours_t:
        assert torch.equal(ours_t[key], theirs_t[key]), key
    assert torch.equal(ours_t["auto.logits"], ours_t["eager.logits"])


def test_accel_writes_no_offload_file_for_safetensors() -> None:
    ours, _ = loading()
    mine = read(ours, "loading")
    assert mine["auto.offload_files"] == [] and mine["explicit.offload_files"] == []


# --- Trainer -----------------------------------------------------------------------------------


@functools.cache
def trainer(processes: int) -> tuple[Path, Path]:
    ours = workspace() / f"trainer-{processes}-accel"
    theirs = workspace() / f"trainer-{processes}-accelerate"
    run("accel", processes, "trainer.py", ours, models())
    # Accelerate trains, then resumes from accel's checkpoints; accel then from Accelerate's
    run("accelerate", processes, "trainer.py", theirs, models(), ours / "checkpoints")
    run("accel", processes, "trainer.py", ours, models(), theirs / "checkpoints")
    return ours, theirs


RUNS = ["causal-fp32", "causal-bf16", "classifier-bf16"]


@pytest.mark.parametrize("processes", [1, 2])
def test_trainer_equals_accelerates_losses_and_weights(processes: int) -> None:
    ours, theirs = trainer(processes)
    mine, reference = read(ours, "train"), read(theirs, "train")
    for run_name in RUNS:
        assert mine[run_name]["world_size"] == processes
        assert mine[run_name]["global_step"] == 6 == reference[run_name]["global_step"]
        assert mine[run_name]["loss"] == pytest.approx(reference[run_name]["loss"], abs=FP32)
        assert mine[run_name]["eval_loss"] == pytest.approx(
            reference[run_name]["eval_loss"], abs=FP32
        )
        difference = max_difference(
            tensors(ours, f"train-{run_name}"), tensors(theirs, f"train-{run_name}")
        )
        assert difference <= FP32, (run_name, difference)


@pytest.mark.parametrize("processes", [1, 2])
def test_each_library_resumes_from_the_others_checkpoint(processes: int) -> None:
    ours, theirs = trainer(processes)
    for run_name in RUNS:
        straight = tensors(theirs, f"train-{run_name}")
        # accel from Accelerate's checkpoint, and Accelerate from accel's
        assert max_difference(tensors(ours, f"resume-{run_name}"), straight) <= FP32, run_name
        assert max_difference(tensors(theirs, f"resume-{run_name}"), straight) <= FP32, run_name
        assert read(ours, "resume")[run_name]["loss"][-1] == pytest.approx(
            read(theirs, "train")[run_name]["loss"][-1], abs=FP32
        )


# --- peft, trl, auto_find_batch_size -----------------------------------------------------------


@functools.cache
def extras() -> tuple[Path, Path]:
    ours, theirs = workspace() / "extras-accel", workspace() / "extras-accelerate"
    run("accel", 1, "extras.py", ours, models())
    run("accelerate", 1, "extras.py", theirs, models())
    return ours, theirs


@pytest.mark.parametrize("part", ["lora", "sft", "auto-batch"])
def test_peft_trl_and_auto_batch_size_equal_accelerates(part: str) -> None:
    ours, theirs = extras()
    key = part.replace("-", "_")
    mine, reference = read(ours, "extras")[key], read(theirs, "extras")[key]
    assert mine["loss"] == pytest.approx(reference["loss"], abs=FP32)
    assert len(mine["loss"]) == 4
    assert max_difference(tensors(ours, part), tensors(theirs, part)) <= FP32
    if part == "auto-batch":
        assert mine["final_batch_size"] == reference["final_batch_size"] < 8
        assert mine["batch_sizes_tried"] == reference["batch_sizes_tried"]
    if part == "lora":
        assert all("lora_" in name for name in tensors(ours, part))


# --- FSDP2 and ZeRO-2 through Trainer, against a plain-torch oracle -----------------------------


@functools.cache
def engines() -> Path:
    out = workspace() / "engines"
    run("accel", 1, "engines.py", out, models(), "oracle")
    for engine in ("fsdp2", "fsdp2-sharded", "zero2"):
        run("accel", 2, "engines.py", out, models(), engine)
    return out


@pytest.mark.parametrize(
    ("engine", "kind", "files"),
    [
        ("fsdp2", "DistributedType.FSDP", {"pytorch_model_fsdp.bin", "optimizer.bin"}),
        (
            "fsdp2-sharded",
            "DistributedType.FSDP",
            {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"},
        ),
        ("zero2", "DistributedType.DEEPSPEED", {"zero_to_fp32.py"}),
    ],
)
def test_trainer_engines_train_save_and_resume_like_the_oracle(
    engine: str, kind: str, files: set[str]
) -> None:
    out = engines()
    oracle, oracle_losses = tensors(out, "oracle"), read(out, "oracle")["loss"]
    for phase in ("train", "resume"):
        found = read(out, f"{engine}-{phase}")
        assert found["distributed_type"] == kind
        assert found["loss"] == pytest.approx(oracle_losses, abs=1e-5)
        assert max_difference(tensors(out, f"{engine}-{phase}"), oracle) <= 1e-6, phase
    saved = {name.split("/", 1)[1] for name in read(out, f"{engine}-train")["checkpoint_files"]}
    assert files <= saved, saved
