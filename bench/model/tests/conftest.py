import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "client" / "python"))
BIN = ROOT / os.environ.get("KVTIER_BUILD", "build") / "bin"
TEXT = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(scope="session")
def model():
    from llama import Model
    return Model()


@pytest.fixture(scope="session")
def text_ids(model):
    return model.tokenizer.encode(Path(TEXT).read_text())
