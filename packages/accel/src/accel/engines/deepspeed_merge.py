"""Turn a DeepSpeed ZeRO checkpoint into one full set of fp32 safetensors weights.

``merge_deepspeed_weights`` is what ``accel merge-weights CHECKPOINT OUT`` runs on a folder
that ``save_state`` wrote under DeepSpeed (or DeepSpeed's own ``save_checkpoint``). It reads
the fp32 master weights out of every rank's optimizer partition with DeepSpeed's
``zero_to_fp32`` reader, on one process and without a process group, and writes
``OUT/model.safetensors`` like ``save_model`` (sharded above ``max_shard_size``). It accepts
the checkpoint root (with its ``latest`` file) or the tag folder inside it
(``.../pytorch_model``). ZeRO-0 checkpoints hold the whole module in the model-states file;
those weights are written as saved. Needs the deepspeed package (``accel[deepspeed]``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["is_deepspeed_checkpoint", "merge_deepspeed_weights", "resolve_deepspeed_tag"]

_MODEL_STATES = "mp_rank_00_model_states.pt"


def _is_tag_folder(folder: Path) -> bool:
    return (folder / _MODEL_STATES).is_file() or any(folder.glob("*_model_states.pt"))


def is_deepspeed_checkpoint(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a DeepSpeed checkpoint root (``latest`` + tag) or its tag folder."""
    path = Path(folder)
    if not path.is_dir():
        return False
    if _is_tag_folder(path):
        return True
    latest = path / "latest"
    return latest.is_file() and _is_tag_folder(path / latest.read_text().strip())


def resolve_deepspeed_tag(checkpoint_dir: str | os.PathLike[str]) -> tuple[Path, str]:
    """``(checkpoint root, tag)`` of a root or a tag folder.

    Raises:
        FileNotFoundError: no such folder, or it is not a DeepSpeed checkpoint (the message
            says what it holds and what to pass).
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"merge-weights: {os.fspath(folder)!r} is not a directory")
    if _is_tag_folder(folder):
        return folder.parent, folder.name
    latest = folder / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if _is_tag_folder(folder / tag):
            return folder, tag
        raise FileNotFoundError(
            f"merge-weights: {os.fspath(latest)!r} names the tag {tag!r}, but "
            f"{os.fspath(folder / tag)!r} holds no DeepSpeed model states: the checkpoint is "
            "incomplete"
        )
    held = sorted(entry.name for entry in folder.iterdir())[:8]
    raise FileNotFoundError(
        f"merge-weights: {os.fspath(folder)!r} is not a DeepSpeed checkpoint: it has no "
        f"'latest' file and no {_MODEL_STATES} (it holds {held}). Pass a folder that "
        "save_state wrote under DeepSpeed, or its pytorch_model/ tag folder"
    )


def _import_zero_to_fp32() -> Any:
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError as error:
        raise ImportError(
            "merge-weights: reading a DeepSpeed checkpoint needs the deepspeed package: "
            'pip install "accel[deepspeed]"'
        ) from error
    return zero_to_fp32


def _zero_stage(tag_folder: Path) -> int:
    import torch

    optim_files = sorted(tag_folder.glob("*zero_pp_rank_*_optim_states.pt"))
    if not optim_files:
        return 0
    state = torch.load(optim_files[0], map_location="cpu", weights_only=False)
    settings = state.get("optimizer_state_dict", {})
    return int(settings.get("zero_stage", 0))


def merge_deepspeed_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
    max_shard_size: int | str = "10GB",
) -> list[str]:
    """Merge a DeepSpeed ZeRO checkpoint into full fp32 weights in ``output_path``.

    Args:
        checkpoint_dir: The checkpoint root (holding ``latest``) or its tag folder.
        output_path: Folder for ``model.safetensors`` (created if missing).
        safe_serialization: Write safetensors (default) instead of ``pytorch_model.bin``.
        remove_checkpoint_dir: Delete the tag folder once the weights are written.
        max_shard_size: Largest output file before the weights are split into shards.

    Returns:
        The names of the files written.

    Raises:
        FileNotFoundError: see :func:`resolve_deepspeed_tag`.
        ImportError: deepspeed is not installed (the message has the install command).
    """
    import torch

    from accel.model_files import save_model_files

    root, tag = resolve_deepspeed_tag(checkpoint_dir)
    tag_folder = root / tag
    zero_to_fp32 = _import_zero_to_fp32()
    if _zero_stage(tag_folder) == 0:
        saved = torch.load(tag_folder / _MODEL_STATES, map_location="cpu", weights_only=False)
        state = {name: tensor.float() for name, tensor in saved["module"].items()}
    else:
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(os.fspath(root), tag=tag)
    # The reader returns views into flat buffers: each weight gets its own storage, and tied
    # parameters (one tensor under several names) stay one tensor, as save_model writes them.
    owned: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in owned:
            owned[key] = tensor.detach().contiguous().clone()
        state[name] = owned[key]
    written = save_model_files(
        state,
        output_path,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
    )
    if remove_checkpoint_dir:
        shutil.rmtree(tag_folder)
    return written
