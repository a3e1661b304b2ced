"""``accel config``: a short questionnaire that writes a launch config file.

It asks what Accelerate's ``accelerate config`` asks for a local machine — the kind of run, the
processes and machines, DeepSpeed or FSDP with their main settings, mixed precision — and
returns the mapping under Accelerate's keys (``deepspeed_config`` and ``fsdp_config`` included),
so the file loads in either tool. An answer outside the offered choices stops the questionnaire
with a message naming the question, the answer and the choices; nothing is written then.
Both engines it asks about, DeepSpeed and FSDP2, exist; answering yes to one that the installed
torch cannot run (FSDP2 needs torch 2.6) stops it the same way, with the refusal ``accel
launch`` would give that config: no file is written that could only be refused later. FSDP
means FSDP2 (the only FSDP accel implements), so no version is asked and no FSDP1-only setting
is offered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from accel_state.engine_requests import (
    EngineRequest,
    EngineUnavailableError,
    refuse_unavailable_engines,
)
from accel_state.enums import PrecisionType

from .engines import (
    FSDP_AUTO_WRAP_POLICIES,
    OFFLOAD_DEVICES,
)

__all__ = ["Ask", "QuestionnaireError", "ask_config"]

#: ``ask(question, default) -> answer``; an empty answer means the default.
Ask = Callable[[str, str], str]

_KINDS = {"no": "NO", "multi-cpu": "MULTI_CPU", "multi-gpu": "MULTI_GPU"}
_YES = ("yes", "y", "true")
_NO = ("no", "n", "false")


class QuestionnaireError(ValueError):
    """An answer that is not one of the choices (the message names both)."""


def _engine_chosen(engine: str, question: str) -> None:
    """Refuse at once an engine that this release or the installed torch cannot run."""
    request = EngineRequest(
        engine, f"the answer yes to {question!r} in accel config", "answer no there"
    )
    try:
        refuse_unavailable_engines([request])
    except EngineUnavailableError as error:
        raise QuestionnaireError(f"accel config: {error}") from error


class _Asker:
    def __init__(self, ask: Ask) -> None:
        self._ask = ask

    def text(self, question: str, default: str) -> str:
        return self._ask(question, default).strip() or default

    def choice(self, question: str, choices: Sequence[str], default: str) -> str:
        answer = self.text(f"{question} ({', '.join(choices)})", default)
        for choice in choices:
            if answer.lower() == choice.lower():
                return choice
        raise QuestionnaireError(
            f"accel config: {answer!r} is not an answer to {question!r}: choose one of "
            f"{', '.join(choices)}, then run `accel config` again"
        )

    def yes_no(self, question: str, default: bool) -> bool:
        answer = self.text(f"{question} (yes/no)", "yes" if default else "no").lower()
        if answer in _YES:
            return True
        if answer in _NO:
            return False
        raise QuestionnaireError(
            f"accel config: {answer!r} is not an answer to {question!r}: answer yes or no, "
            "then run `accel config` again"
        )

    def integer(self, question: str, default: int, minimum: int) -> int:
        answer = self.text(question, str(default))
        try:
            value = int(answer)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise QuestionnaireError(
                f"accel config: {answer!r} is not an answer to {question!r}: give a whole "
                f"number >= {minimum}, then run `accel config` again"
            )
        return value

    def number(self, question: str, default: float) -> float:
        answer = self.text(question, str(default))
        try:
            value = float(answer)
        except ValueError:
            value = 0.0
        if value <= 0:
            raise QuestionnaireError(
                f"accel config: {answer!r} is not an answer to {question!r}: give a number "
                "> 0, then run `accel config` again"
            )
        return value

    def required(self, question: str) -> str:
        answer = self.text(question, "")
        if not answer:
            raise QuestionnaireError(
                f"accel config: {question!r} needs an answer; run `accel config` again"
            )
        return answer


def _deepspeed(ask: _Asker) -> dict[str, Any]:
    """``deepspeed_config`` with Accelerate's keys."""
    config: dict[str, Any] = {}
    stage = None
    if ask.yes_no("Do you want to use a DeepSpeed JSON config file?", False):
        config["deepspeed_config_file"] = ask.required("Path of the DeepSpeed JSON config file?")
    else:
        stage = int(ask.choice("Which ZeRO stage?", ["0", "1", "2", "3"], "2"))
        config["zero_stage"] = stage
        if stage >= 2:
            optimizer = ask.choice("Where to offload optimizer states?", OFFLOAD_DEVICES, "none")
            config["offload_optimizer_device"] = optimizer
            if optimizer == "nvme":
                config["offload_optimizer_nvme_path"] = ask.text(
                    "NVMe folder for optimizer states?", "/nvme"
                )
        if stage == 3:
            param = ask.choice("Where to offload parameters?", OFFLOAD_DEVICES, "none")
            config["offload_param_device"] = param
            if param == "nvme":
                config["offload_param_nvme_path"] = ask.text("NVMe folder for parameters?", "/nvme")
        config["gradient_accumulation_steps"] = ask.integer(
            "How many gradient accumulation steps does your script use?", 1, 1
        )
        if ask.yes_no("Do you want gradient clipping?", False):
            config["gradient_clipping"] = ask.number("Gradient clipping norm?", 1.0)
        if stage == 3:
            config["zero3_save_16bit_model"] = ask.yes_no(
                "Save 16-bit model weights when saving with ZeRO-3?", False
            )
    if stage is None or stage == 3:
        config["zero3_init_flag"] = ask.yes_no(
            "Build the model under deepspeed.zero.Init (ZeRO-3, for models too big for one "
            "device)?",
            False,
        )
    if ask.yes_no("Do you train a Mixture-of-Experts model?", False):
        config["deepspeed_moe_layer_cls_names"] = ask.required(
            "Comma-separated MoE layer class names (e.g. MixtralSparseMoeBlock)?"
        )
    return config


def _fsdp(ask: _Asker) -> dict[str, Any]:
    """``fsdp_config`` with Accelerate's keys (``fsdp_`` prefixed)."""
    config: dict[str, Any] = {}
    # accel implements FSDP2 only (an FSDP1 plugin is refused), so there is no version to ask.
    config["fsdp_version"] = 2
    config["fsdp_reshard_after_forward"] = ask.yes_no("Reshard the parameters after forward?", True)
    config["fsdp_offload_params"] = ask.yes_no(
        "Offload parameters and gradients to the CPU?", False
    )
    policy = ask.choice(
        "Which auto wrap policy?", FSDP_AUTO_WRAP_POLICIES, "TRANSFORMER_BASED_WRAP"
    )
    config["fsdp_auto_wrap_policy"] = policy
    if policy == "TRANSFORMER_BASED_WRAP":
        if not ask.yes_no("Wrap the classes in the model's _no_split_modules?", False):
            config["fsdp_transformer_layer_cls_to_wrap"] = ask.required(
                "Comma-separated layer class names to wrap (e.g. LlamaDecoderLayer)?"
            )
    elif policy == "SIZE_BASED_WRAP":
        config["fsdp_min_num_params"] = ask.integer(
            "Smallest number of parameters of a wrapped module?", 100_000_000, 0
        )
    state_dicts = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    config["fsdp_state_dict_type"] = ask.choice(
        "Which state dict type for checkpoints?", state_dicts, state_dicts[0]
    )
    config["fsdp_cpu_ram_efficient_loading"] = ask.yes_no(
        "Load the checkpoint on rank 0 only (CPU-RAM-efficient loading)?", True
    )
    config["fsdp_activation_checkpointing"] = ask.yes_no("Use activation checkpointing?", False)
    return config


def ask_config(ask: Ask) -> dict[str, Any]:
    """Ask the questions through ``ask`` and return the config file's mapping.

    Args:
        ask: ``ask(question, default) -> answer``; an empty answer takes the default.

    Returns:
        The mapping to write (Accelerate's keys), ready for ``ClusterConfig.from_dict``.

    Raises:
        QuestionnaireError: an answer is not one of the choices of its question, or chooses
            an engine that this release or the installed torch cannot run (FSDP2 before
            torch 2.6).
    """
    asker = _Asker(ask)
    kind = asker.choice("Which kind of machine?", list(_KINDS), "no")
    processes = asker.integer("How many processes in total?", 1 if kind == "no" else 2, 1)
    machines = asker.integer("How many machines?", 1, 1)
    data: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": _KINDS[kind],
        "num_processes": processes,
        "num_machines": machines,
        "use_cpu": kind != "multi-gpu",
        "debug": False,
    }
    if machines > 1:
        data["machine_rank"] = asker.integer("This machine's rank?", 0, 0)
        data["main_process_ip"] = asker.text("The main machine's IP address?", "127.0.0.1")
        data["main_process_port"] = asker.integer("A free port on it?", 29500, 1)
    deepspeed = "Do you want to use DeepSpeed?"
    fsdp = "Do you want to use FullyShardedDataParallel (FSDP)?"
    if asker.yes_no(deepspeed, False):
        _engine_chosen("deepspeed", deepspeed)
        data["distributed_type"] = "DEEPSPEED"
        data["deepspeed_config"] = _deepspeed(asker)
    elif processes > 1 and asker.yes_no(fsdp, False):
        _engine_chosen("fsdp", fsdp)
        data["distributed_type"] = "FSDP"
        data["fsdp_config"] = _fsdp(asker)
    data["mixed_precision"] = asker.choice("Mixed precision?", PrecisionType.list(), "no")
    return data
