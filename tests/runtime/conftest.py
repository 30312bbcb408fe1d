"""Runtime tests run many tiny torch ops (toy and tiny models): on a shared 2-core machine thread
hand-offs cost more than the math, so these tests run torch on one thread."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_ckpt_root(tmp_path_factory):
    """A tiny fp32 transformers DeepseekV3 checkpoint with the tiny tokenizer, written once: as one file ("single")
    and sharded with an index ("sharded")."""
    pytest.importorskip("transformers")
    from pdlab.runtime.model.testing import hf_config, hf_model
    from pdlab.runtime.model.tiny import write_tokenizer

    root = tmp_path_factory.mktemp("tiny_ckpt")
    hf = hf_model(hf_config(layers=2), seed=5)
    for name, kw in (("single", {}), ("sharded", {"max_shard_size": "200KB"})):
        hf.save_pretrained(root / name, **kw)
        write_tokenizer(root / name)
    return root


@pytest.fixture
def tiny_ckpt(tiny_ckpt_root, tmp_path):
    """copy(name) → a fresh copy of the "single" or "sharded" tiny checkpoint under tmp_path, free to break."""
    import shutil

    def copy(name: str):
        d = tmp_path / name
        shutil.copytree(tiny_ckpt_root / name, d)
        return d

    return copy
