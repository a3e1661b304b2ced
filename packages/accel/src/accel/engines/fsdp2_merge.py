"""Turn FSDP2's sharded (DCP) checkpoint folders into one full set of safetensors weights.

``merge_fsdp_weights`` is what ``accel merge-weights CHECKPOINT OUT`` runs. It reads a DCP
folder on one process, without a process group (DCP reassembles every tensor from the shard
files), drops the single top-level key that ``save_state`` writes under (``"model"``), and
writes ``OUT/model.safetensors`` (``pytorch_model.bin`` with ``safe_serialization=False``),
sharded above ``max_shard_size`` like ``save_model``. It accepts the DCP folder itself
(``.../pytorch_model_fsdp_0``) or the checkpoint root that holds it (Accelerate only accepts
the former, and fails inside DCP on the latter).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from .fsdp2_checkpoint import MODEL_FOLDER

__all__ = ["merge_fsdp_weights", "resolve_model_folder"]


def resolve_model_folder(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """The DCP model folder of ``checkpoint_dir`` (the folder itself or a checkpoint root).

    Raises:
        FileNotFoundError: no such folder, or it holds no DCP model folder (the message says
            what it holds and what to pass).
        ValueError: the root holds several models' folders (name the one to merge).
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"merge-weights: {os.fspath(folder)!r} is not a directory")
    if (folder / ".metadata").is_file():
        return folder
    candidates = sorted(
        entry
        for entry in folder.iterdir()
        if entry.is_dir()
        and entry.name.startswith(f"{MODEL_FOLDER}_")
        and (entry / ".metadata").is_file()
    )
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        names = ", ".join(entry.name for entry in candidates)
        raise ValueError(
            f"merge-weights: {os.fspath(folder)!r} holds the sharded weights of several models "
            f"({names}); pass the folder of the one to merge"
        )
    held = sorted(entry.name for entry in folder.iterdir())[:8]
    raise FileNotFoundError(
        f"merge-weights: {os.fspath(folder)!r} is not a sharded FSDP checkpoint: it has no "
        f"DCP .metadata and no {MODEL_FOLDER}_<i>/ folder (it holds {held}), and not a "
        "DeepSpeed checkpoint either (no 'latest' file, no model states). Pass a folder that "
        "save_state wrote with SHARDED_STATE_DICT (or its pytorch_model_fsdp_<i> folder), or "
        "one that save_state wrote under DeepSpeed"
    )


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
    max_shard_size: int | str = "10GB",
) -> list[str]:
    """Merge a sharded FSDP2 checkpoint into full weights in ``output_path``.

    Args:
        checkpoint_dir: A ``pytorch_model_fsdp_<i>`` DCP folder, or the checkpoint holding one.
        output_path: Folder for ``model.safetensors`` (created if missing).
        safe_serialization: Write safetensors (default) instead of ``pytorch_model.bin``.
        remove_checkpoint_dir: Delete the DCP folder once the weights are written.
        max_shard_size: Largest output file before the weights are split into shards.

    Returns:
        The names of the files written.

    Raises:
        FileNotFoundError, ValueError: see :func:`resolve_model_folder`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from accel.model_files import save_model_files

    folder = resolve_model_folder(checkpoint_dir)
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=dcp.FileSystemReader(folder),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    if len(state) == 1 and isinstance(next(iter(state.values())), dict):
        state = next(iter(state.values()))
    written = save_model_files(
        state,
        output_path,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
    )
    if remove_checkpoint_dir:
        shutil.rmtree(folder)
    return written
