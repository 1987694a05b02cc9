"""A checkpoint is data: finding one, checking its card, and loading its MaskablePPO policy without
running any code from it.

A stable-baselines3 zip keeps, in its ``data`` entry, a JSON object in which some fields
(``policy_class``, the spaces, the schedules, the rollout buffer class, the last observations...) are
cloudpickled; ``MaskablePPO.load`` unpickles them, and unpickling runs whatever the file says (the
exposure ``torch.load`` closed with ``weights_only=True`` in PyTorch 2.6). :func:`load_ppo` hands
stable-baselines3 every one of those fields through ``custom_objects`` (which it then never
deserializes), rebuilt from this code: the policy class and the spaces from :class:`SwapEnv`, the
schedules from the plain numbers in the file and the card, the rollout buffer and the last
observations left for ``learn`` to make afresh. A pickled field this code does not rebuild is
refused before stable-baselines3 sees the file. The weights (``*.pth``) are read by stable-baselines3
with ``torch.load(weights_only=True)``, which loads tensors and plain containers only.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from swapsched._paths import checkpoint_dir
from swapsched.errors import UserError

__all__ = ["CheckpointError", "resolve_checkpoint", "check_card", "load_ppo", "ENV_VERSION", "REBUILT_ENTRIES"]


class CheckpointError(UserError):
    """A checkpoint is missing, unreadable, or holds something this code will not load."""


#: What a checkpoint's observations and actions mean; a card recording another version was trained
#: for a different SwapEnv and cannot be used by this code.
ENV_VERSION = 1

#: The pickled fields of a MaskablePPO zip, each rebuilt by :func:`load_ppo` instead of unpickled.
REBUILT_ENTRIES = ("policy_class", "observation_space", "action_space", "clip_range", "lr_schedule",
                   "rollout_buffer_class", "_last_obs", "_last_episode_starts", "_last_original_obs",
                   "ep_info_buffer", "ep_success_buffer", "clip_range_vf")


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A shipped policy's name (``default``) or a ``.zip`` path, as the path of an existing file."""
    p = Path(name_or_path)
    if p.suffix == ".zip" or p.is_file():
        if not p.is_file():
            raise CheckpointError(f"checkpoint {p} not found")
        return p
    cand = checkpoint_dir() / f"{name_or_path}.zip"
    if not cand.is_file():
        known = sorted(q.stem for q in checkpoint_dir().glob("*.zip"))
        raise CheckpointError(
            f"no pretrained policy {str(name_or_path)!r}; shipped: {', '.join(known) or 'none'} "
            "(train one with: swapsched train-policy)"
        )
    return cand


def check_card(path: Path) -> dict[str, Any]:
    """The checkpoint's card (``NAME.json``), checked against this code's ``ENV_VERSION``."""
    card_path = path.with_suffix(".json")
    if not card_path.is_file():
        return {}
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint card {card_path} is unreadable ({exc}); delete it or retrain") from None
    version = card.get("env_version", 1) if isinstance(card, dict) else None
    if version != ENV_VERSION:
        raise CheckpointError(f"checkpoint {path.name} was trained for SwapEnv version {version}, this swapsched has "
                              f"version {ENV_VERSION}; retrain it with: swapsched train-policy --out {path}")
    return card


def _read_data(path: Path) -> dict[str, Any]:
    """The zip's ``data`` entry as plain JSON (nothing deserialized)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if "data" not in names or "policy.pth" not in names:
                raise CheckpointError(f"checkpoint {path} is not a MaskablePPO checkpoint (no 'data' or 'policy.pth' in "
                                      "the zip); train one with: swapsched train-policy")
            data = json.loads(archive.read("data").decode())
    except CheckpointError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {path}: its 'data' is not a JSON object")
    return data


def _number(data: dict[str, Any], key: str, default: float, path: Path) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"checkpoint {path}: {key!r} must be a positive number, got {value!r}")
    return float(value)


def _net_arch(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``policy_kwargs`` as this project writes it: ``{"net_arch": [ints]}`` and nothing else (any
    other key would name a class or a function, which plain JSON cannot carry safely)."""
    kwargs = data.get("policy_kwargs", {})
    if not isinstance(kwargs, dict) or set(kwargs) - {"net_arch"}:
        raise CheckpointError(f"checkpoint {path}: policy_kwargs may hold only 'net_arch', got {kwargs!r}")
    arch = kwargs.get("net_arch", [64, 64])
    if not isinstance(arch, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in arch):
        raise CheckpointError(f"checkpoint {path}: net_arch must be a list of positive integers, got {arch!r}")
    return {"net_arch": list(arch)}


def load_ppo(path: str | Path, env: Any = None, *, card: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """The MaskablePPO model in ``path``, loaded with no pickle deserialized (see the module).

    ``env``: the vectorized environment to continue training in (``--resume``), or None to plan.
    ``card``: the checkpoint's card, whose ``config.ppo.clip_range`` the clip schedule is rebuilt
    from (0.2, stable-baselines3's default, where the card has none). ``kwargs`` go to
    ``MaskablePPO.load`` (``device``, ``tensorboard_log``)."""
    from sb3_contrib import MaskablePPO
    from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy

    from swapsched.env.swap_env import SwapEnv

    path = Path(path)
    data = _read_data(path)
    pickled = sorted(k for k, v in data.items() if isinstance(v, dict) and ":serialized:" in v)
    unknown = [k for k in pickled if k not in REBUILT_ENTRIES]
    if unknown:
        raise CheckpointError(f"checkpoint {path} holds pickled field(s) {unknown} that swapsched does not rebuild; "
                              "it is not loaded, since unpickling would run code from the file")
    cls = data.get("policy_class")
    module = cls.get("__module__") if isinstance(cls, dict) else None  # SB3 writes it as plain text beside the pickle
    if module != MaskableActorCriticPolicy.__module__:
        raise CheckpointError(f"checkpoint {path} is not a MaskablePPO checkpoint (its policy class is from {module!r}); "
                              "train one with: swapsched train-policy")
    ppo = ((card or {}).get("config") or {}).get("ppo") or {}
    observation_space, action_space = SwapEnv.spaces()
    rebuilt: dict[str, Any] = {
        "policy_class": MaskableActorCriticPolicy,
        "observation_space": observation_space,
        "action_space": action_space,
        # PPO._setup_model turns a float into its constant schedule; lr_schedule is rebuilt there
        # from the plain `learning_rate`, so the value given here is never used
        "clip_range": _number(ppo, "clip_range", 0.2, path),
        "clip_range_vf": None,
        "lr_schedule": None,
        "rollout_buffer_class": None,  # MaskablePPO._setup_model picks MaskableRolloutBuffer
        # None makes learn() reset the environment and start fresh episode statistics
        "_last_obs": None, "_last_episode_starts": None, "_last_original_obs": None,
        "ep_info_buffer": None, "ep_success_buffer": None,
    }
    _number(data, "learning_rate", 3e-4, path)
    if "policy_kwargs" in data:
        _net_arch(data, path)
    try:
        return MaskablePPO.load(str(path), env=env, custom_objects=rebuilt, **kwargs)
    except Exception as exc:  # a hand-edited file breaks in many ways; none of them runs its code
        raise CheckpointError(f"cannot load checkpoint {path}: {type(exc).__name__}: {exc}".split("\n")[0]) from None
