"""--moe-weights-layout fragment|tiled on experts that cannot be stored so (a bf16 checkpoint): one message naming the
flag, the reason and the fix (it was the layout converter's own 'frag_: needs NVFP4 weights ...')."""

import pytest

from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.model.testing import hf_config, hf_model
from pdlab.runtime.model.tiny import write_tokenizer

pytest.importorskip("transformers")


@pytest.mark.parametrize("layout", ["fragment", "tiled"])
def test_a_tile_layout_for_experts_that_cannot_take_it_is_named(tmp_path, layout):
    hf_model(hf_config(layers=2), seed=5).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=rf"--moe-weights-layout {layout}: .*not NVFP4 \(bf16 checkpoint\).*auto"):
        LLM(model_path=str(tmp_path), device="cpu", dtype="fp32", moe_weights_layout=layout, max_total_tokens=1024,
            max_context_len=128)
    llm = LLM(model_path=str(tmp_path), device="cpu", dtype="fp32", moe_weights_layout="auto", max_total_tokens=1024,
              max_context_len=128)
    assert llm.generate([[5, 6]])[0]["error"] is None
