"""``import accel`` loads what constructing an ``Accelerator`` needs, and nothing else.

The engines, their plugins, the trackers, the launcher's config (and YAML), the big-model
machinery and psutil load when first used; each test runs a fresh interpreter, since this
one has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules (and packages: every submodule counts) that ``import accel`` must not load.
FORBIDDEN = (
    "psutil",
    "yaml",
    "accel_launch",
    "accel_bigmodel",
    "accel.engines.ddp",
    "accel.engines.single",
    "accel.engines.fsdp2",
    "accel.engines.fsdp_plugin",
    "accel.engines.deepspeed",
    "accel.engines.deepspeed_plugin",
    "accel.engines.tensor_parallel",
    "accel.engines.xla",
    "accel.engine_plugins",
    "accel.tracking.registry",
    "accel.tracking.wandb",
    "accel.tracking.mlflow",
    "accel.tracking.local",
    "accel.utils",
    "deepspeed",
)


def _loaded_after(code: str) -> list[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def _forbidden_in(modules: list[str]) -> list[str]:
    return [
        name
        for name in modules
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    ]


def test_import_accel_loads_no_forbidden_module() -> None:
    loaded = _loaded_after("import accel")
    assert "accel.accelerator" in loaded  # what a training loop needs is there
    assert _forbidden_in(loaded) == []


def test_building_an_accelerator_loads_only_its_engine() -> None:
    loaded = _loaded_after(
        "import accel\naccel.Accelerator(cpu=True)\n"
        "from accel_state import AcceleratorState\nAcceleratorState._reset_state(True)"
    )
    assert "accel.engines.single" in loaded
    assert [m for m in _forbidden_in(loaded) if m != "accel.engines.single"] == []


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("FullyShardedDataParallelPlugin", "accel.engines.fsdp_plugin"),
        ("load_checkpoint_and_dispatch", "accel_bigmodel"),
        ("notebook_launcher", "accel_launch"),
        ("utils", "accel.utils"),
    ],
)
def test_lazy_names_load_on_first_use(name: str, module: str) -> None:
    loaded = _loaded_after(f"import accel\nvalue = accel.{name}\nassert value is accel.{name}")
    assert module in loaded


def test_every_public_name_resolves() -> None:
    import accel

    missing = [name for name in accel.__all__ if not hasattr(accel, name)]
    assert missing == []
    assert set(accel.__all__) <= set(dir(accel))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = accel.no_such_name  # type: ignore[attr-defined]
