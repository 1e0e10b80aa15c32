"""The SGLang contract tier (`make contract`): kuberl's engine command lines and request bodies
checked against the pinned SGLang release's own code.

`make contract` installs that release's wheel without its dependencies (requirements.txt
here: the few pure/CPU packages importing its parser and request types needs) into a cache
directory and names it in KUBERL_SGLANG_PATH. Without that variable the tier is not collected
(`make unit` runs the rest of tests/); with it, a missing or different SGLang fails loudly.
"""

from __future__ import annotations

import ast
import os
import sys
import types
from pathlib import Path

SGLANG_PATH = os.environ.get("KUBERL_SGLANG_PATH")
collect_ignore_glob = [] if SGLANG_PATH else ["test_*.py"]

if SGLANG_PATH:
    if not Path(SGLANG_PATH, "sglang").is_dir():
        raise RuntimeError(f"KUBERL_SGLANG_PATH={SGLANG_PATH} holds no sglang package "
                           "(make contract installs it)")
    sys.path.insert(0, SGLANG_PATH)


def load_io_struct() -> types.ModuleType:
    """sglang.srt.managers.io_struct, imported from the pinned wheel.

    io_struct imports BaseFinishReason from sglang.srt.managers.schedule_batch, which imports
    the model-execution layers and through them sgl_kernel: a CUDA-only extension (its
    common_ops library is built for and loads only with the CUDA runtime), so schedule_batch
    cannot be imported on a CPU machine. Everything else io_struct needs imports on CPU. So
    schedule_batch is replaced by a module holding just its finish-reason classes, compiled
    from the wheel's own schedule_batch.py source (the pinned version's code, not a copy);
    the request dataclasses themselves are SGLang's, executed as shipped.
    """
    name = "sglang.srt.managers.schedule_batch"
    if name not in sys.modules:
        import sglang

        path = Path(sglang.__file__).parent / "srt" / "managers" / "schedule_batch.py"
        tree = ast.parse(path.read_text(), str(path))
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)
                   and (n.name == "BaseFinishReason" or n.name.startswith("FINISH_"))]
        assert any(c.name == "BaseFinishReason" for c in classes), path
        header = ast.parse("from typing import List, Optional, Union").body
        module = types.ModuleType(name)
        module.__file__ = str(path)
        code = compile(ast.Module(body=[*header, *classes], type_ignores=[]), str(path), "exec")
        exec(code, module.__dict__)
        sys.modules[name] = module
    from sglang.srt.managers import io_struct

    return io_struct
