"""Load a DeepSeek-V3/R1 model: from a local HF directory (bf16/fp32 or modelopt NVFP4 safetensors),
from an in-memory state dict, or (path None) the embedded tiny default.

Checkpoint tensors keep their HF names. Non-expert `gate_proj`/`up_proj` pairs are merged into
`gate_up_proj`; routed experts (`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.*`) are stacked
per layer into one `ExpertWeights` (bf16: `from_bf16`; NVFP4: `from_modelopt`). NVFP4 linears outside
the experts (not in `exclude_modules`) are dequantized to the model dtype at load. Layers at index
>= num_hidden_layers (DeepSeek's MTP module) are skipped with a log line."""

from __future__ import annotations

import json
import logging
import re
import zlib
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from pdlab.runtime.model.config import ConfigError, ModelConfig, read_json_object
from pdlab.runtime.model.deepseek_v3 import DeepseekV3ForCausalLM, MoEBlock
from pdlab.runtime.model.tokenizer import Tokenizer

log = logging.getLogger("pdlab.runtime.model")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                        r"(weight|weight_scale|weight_scale_2|input_scale)$")
_QUANT_AUX = ("weight_scale", "weight_scale_2", "input_scale")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale")


EXPERT_CHUNK = 8
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor (and file)."""


@dataclass
class LoadOptions:
    """How to build the served model.

    attn_backend / attn_config: for every mla_prefill / mla_decode call (None = registry choice).
    moe_runner / dispatcher: passed to each MoELayer. moe_decode_mode: the dispatch mode of decode
        steps ("normal" or "low_latency"); prefill/extend steps use "normal".
    quantize_experts: quantize bf16 experts to NVFP4 at load (ExpertWeights.from_bf16(quantize=True)).
    ep_size / ep_rank / ep_group: expert parallelism of the MoE layers; explicit so that a process
        group initialised for something else (KV transfer) is never mistaken for an EP group.
    moe_kwargs: further MoELayer arguments (payload, num_max_dispatch_tokens_per_rank,
        max_num_tokens, runner_config, route_backend, ...)."""

    attn_backend: str | None = None
    attn_config: dict | None = None
    moe_runner: str | None = None
    dispatcher: str = "local"
    moe_decode_mode: str = "normal"
    quantize_experts: bool = False
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: object = None
    moe_kwargs: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# tensor sources


class TensorSource(ABC):
    """Named checkpoint tensors: keys(), get(name) → CPU tensor, where(name) → file for messages."""

    @abstractmethod
    def keys(self) -> Iterable[str]:
        """Every tensor name the source holds."""

    @abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`, of the shape [...] and dtype it is stored with."""

    def where(self, name: str) -> str:
        return "the checkpoint"


class SafetensorsSource(TensorSource):
    """`model.safetensors.index.json` (sharded) or `model.safetensors` / `*.safetensors` in a directory.
    Every file's header is read at construction: a truncated or corrupt file, and a tensor the index places in
    a shard that does not hold it, are named before any weight is loaded."""

    def __init__(self, path: Path):
        self.path = path
        self._handles: dict[str, Any] = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_index(index)
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise FileNotFoundError(f"{index.name} in {path} names shard(s) that are not there: "
                                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                                        "download the complete checkpoint")
            by_file: dict[str, list[str]] = defaultdict(list)
            for name, f in weight_map.items():
                by_file[f].append(name)
            for f, names in sorted(by_file.items()):
                held = set(self._open(f).keys())
                absent = [n for n in names if n not in held]
                if absent:
                    more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
                    raise CheckpointError(f"tensor {absent[0]!r}{more} is not in {f}, where {index} places it: "
                                          "the index does not match its shards; download the checkpoint again")
        else:
            files = [path / "model.safetensors"] if (path / "model.safetensors").is_file() else sorted(
                path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no weights in {path}: expected model.safetensors, "
                                        "model.safetensors.index.json with its shards, or *.safetensors files")
            weight_map = {}
            for f in files:
                for k in self._open(f.name).keys():
                    if k in weight_map:
                        raise CheckpointError(f"tensor {k!r} is in both {weight_map[k]} and {f.name} in {path}, which "
                                              "has no model.safetensors.index.json to say which to load: remove the "
                                              "stale file (or add the index)")
                    weight_map[k] = f.name
        self.weight_map = weight_map

    def _open(self, fname: str):
        """The open handle of file `fname` (its header read); CheckpointError naming it if it cannot be read."""
        if fname not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[fname] = safe_open(str(self.path / fname), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{self.path / fname} cannot be read as safetensors ({exc}): the file is "
                                      "truncated or corrupt (an interrupted download?); download it again") from None
        return self._handles[fname]

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` read from its shard, [...] and dtype as stored; CheckpointError for a damaged file."""
        from safetensors import SafetensorError

        try:
            return self._open(self.weight_map[name]).get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"tensor {name!r} cannot be read from {self.where(name)} ({exc}): the file is "
                                  "truncated or corrupt; download it again") from None

    def where(self, name: str) -> str:
        """The file holding `name`; the directory for a name the checkpoint lacks."""
        return str(self.path / self.weight_map[name]) if name in self.weight_map else str(self.path)


def _read_index(index: Path) -> dict[str, str]:
    """The `weight_map` (tensor name → shard file) of a `model.safetensors.index.json`."""
    try:
        data = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index} is not valid JSON ({exc}); download it again") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no 'weight_map' object of tensor name -> shard file; download it again, "
                              "or remove it to load every *.safetensors file in the directory")
    return weight_map


class DictSource(TensorSource):
    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str = "the state dict"):
        self.tensors, self.label = tensors, label

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as given, [...] any shape and dtype."""
        return self.tensors[name]

    def where(self, name: str) -> str:
        return self.label


class RandomSource(TensorSource):
    """Seeded random bf16-layout weights for a config (every tensor of `checkpoint_shapes`), each from
    its own seed (seed, name), so a tensor's values do not depend on load order or device.
    gen_device: where numbers are drawn ("cpu" gives the same model on every device)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, gen_device: str | torch.device = "cpu"):
        self.cfg, self.seed, self.gen_device = cfg, seed, torch.device(gen_device)
        self.shapes = checkpoint_shapes(cfg)

    def keys(self) -> Iterable[str]:
        return self.shapes.keys()

    def get(self, name: str) -> torch.Tensor:
        """A random tensor of `name`'s shape [...] and dtype, the same for the same seed and name."""
        shape = self.shapes[name]
        g = torch.Generator(self.gen_device).manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        dev = self.gen_device
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * torch.randn(shape, generator=g, device=dev)
        if name.endswith("e_score_correction_bias"):
            return 0.05 * torch.rand(shape, generator=g, device=dev)
        if name.endswith("embed_tokens.weight"):
            return torch.randn(shape, generator=g, device=dev)
        gain = 4.0 if name == "lm_head.weight" else 1.0
        return torch.randn(shape, generator=g, device=dev) * (gain / shape[-1] ** 0.5)

    def where(self, name: str) -> str:
        return f"random weights (seed {self.seed})"


# ---------------------------------------------------------------------------------------------
# expected checkpoint layout


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized HF checkpoint of `cfg` (no MTP layers) → its shape."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = (nh * cfg.qk_head_dim, H)
        else:
            out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
            out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
        out[a + "kv_a_proj_with_mqa.weight"] = (cfg.latent_dim, H)
        out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[a + "o_proj.weight"] = (H, nh * cfg.v_head_dim)
        if cfg.attention_bias:
            if cfg.q_lora_rank is not None:
                out[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
            out[a + "kv_a_proj_with_mqa.bias"] = (cfg.latent_dim,)
            out[a + "o_proj.bias"] = (H,)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            out[m + "gate.weight"] = (cfg.n_routed_experts, H)
            out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                _mlp_shapes(out, f"{m}experts.{e}.", H, cfg.moe_intermediate_size)
            if cfg.n_shared_experts:
                _mlp_shapes(out, m + "shared_experts.", H, cfg.n_shared_experts * cfg.moe_intermediate_size)
        else:
            _mlp_shapes(out, m, H, cfg.intermediate_size)
    return out


def _mlp_shapes(out: dict, prefix: str, H: int, inter: int) -> None:
    out[prefix + "gate_proj.weight"] = (inter, H)
    out[prefix + "up_proj.weight"] = (inter, H)
    out[prefix + "down_proj.weight"] = (H, inter)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, nvfp4_experts: bool = False,
                 ep_size: int = 1) -> int:
    """Bytes the served model's weights take on its device, from the config alone (no loop over layers or
    experts, so an absurd config is sized at once): every linear, norm and embedding in `dtype`, the router in
    fp32, the absorbed W_UK / W_UV copies of kv_b_proj, and the routed experts in `dtype` or, with
    `nvfp4_experts`, as NVFP4 (half a byte per weight plus one e4m3 scale per 16), E / ep_size of them per rank.
    A lower bound: the loader's temporaries are not counted."""
    b = torch.empty((), dtype=dtype).element_size()
    H, nh, L, E = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers, cfg.n_routed_experts
    if cfg.q_lora_rank is None:
        q = nh * cfg.qk_head_dim * H
    else:
        q = cfg.q_lora_rank * (H + 1 + nh * cfg.qk_head_dim)
    kv_b = nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    attn = q + cfg.latent_dim * H + cfg.kv_lora_rank + 2 * kv_b + H * nh * cfg.v_head_dim + 2 * H
    n_moe = max(0, L - cfg.first_k_dense_replace) if E > 0 else 0
    expert = 3 * cfg.moe_intermediate_size * H
    expert_bytes = expert * (0.5 + 1 / 16) if nvfp4_experts else expert * b
    local = -(-E // max(1, ep_size))  # this rank's experts
    moe = 3 * H * cfg.n_shared_experts * cfg.moe_intermediate_size * b + E * (H + 1) * 4 + local * expert_bytes
    embed = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + H
    return int((embed + L * attn + (L - n_moe) * 3 * H * cfg.intermediate_size) * b + n_moe * moe)


def check_weights_fit(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                      nvfp4_experts: bool = False, fix: str | None = None, ep_size: int = 1) -> None:
    """Raise MemoryBudgetError (a ValueError) before anything is allocated when `weight_bytes` exceeds the memory
    `device` has available, naming the model's size and the estimate."""
    from pdlab.runtime.memory.budget import check_fits

    what = (f"the model weights ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.n_routed_experts} experts of {cfg.moe_intermediate_size}"
            f"{f' over {ep_size} ranks' if ep_size > 1 else ''}, vocab {cfg.vocab_size}, "
            f"{str(dtype).replace('torch.', '')}{', NVFP4 experts' if nvfp4_experts else ''})")
    check_fits(what, weight_bytes(cfg, dtype, nvfp4_experts, ep_size), device,
               fix or "serve a smaller model, or use a device with more memory")


# ---------------------------------------------------------------------------------------------
# public entry points


def load_model(path: str | Path | None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               *, options: LoadOptions | None = None, require_tokenizer: bool = True,
               ) -> tuple[DeepseekV3ForCausalLM, Tokenizer | None, ModelConfig]:
    """Build the model for serving.

    Args:
        path: a local HF directory (config.json, safetensors, tokenizer.json; optional
            hf_quant_config.json), or None for the embedded tiny default (random NVFP4 experts).
        device: where weights live. dtype: activation/weight dtype of non-expert layers (bf16 |
            fp16 | fp32); the router stays fp32.
        options: backends and MoE runner (LoadOptions). require_tokenizer: False returns None when
            the directory has no tokenizer.json.
    Returns: (model, tokenizer, config)."""
    options = options or LoadOptions()
    if path is None:
        from pdlab.runtime.model import tiny

        return tiny.load_tiny(device, dtype, options=options)
    path = Path(path)
    cfg = read_model_config(path)
    tokenizer = None
    if require_tokenizer or (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(path, extra_eos_ids=cfg.eos_token_ids)
        if tokenizer.max_token_id >= cfg.vocab_size:
            # vocab_size above the tokenizer's is common (padded embeddings); below it, text hitting those ids is
            # refused per request (400): say so once at load
            log.warning("%s holds token ids up to %d but config.json's vocab_size is %d: prompts whose text "
                        "encodes to ids >= %d will be refused; the tokenizer does not belong to these weights?",
                        path / "tokenizer.json", tokenizer.max_token_id, cfg.vocab_size, cfg.vocab_size)
    model = build_model(cfg, SafetensorsSource(path), device, dtype, options=options)
    return model, tokenizer, cfg


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local HF checkpoint directory (its config.json, and hf_quant_config.json or a
    quantization_config with quant_algo), without reading any weight. FileNotFoundError for a path that is not
    such a directory, ConfigError naming the file and field otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is not a directory: pass a local HF checkpoint directory "
                                "(config.json + *.safetensors + tokenizer.json), or no path for the tiny default")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"config.json not found in {path}: a HF checkpoint directory has config.json "
                                "next to its safetensors")
    hf = read_json_object(cfg_file)
    quant = None
    if (path / "hf_quant_config.json").is_file():
        quant = read_json_object(path / "hf_quant_config.json")
    elif isinstance(hf.get("quantization_config"), Mapping) and hf["quantization_config"].get("quant_algo"):
        quant = hf["quantization_config"]
    return ModelConfig.from_hf(hf, quant)


def build_model(cfg: ModelConfig, source: TensorSource, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.bfloat16, *, options: LoadOptions | None = None) -> DeepseekV3ForCausalLM:
    """Construct DeepseekV3ForCausalLM on `device` and fill it from `source` (each tensor checked against the shape
    [...] the config gives it, every tensor accounted for). Raises CheckpointError naming the offending tensor."""
    options = options or LoadOptions()
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype {dtype} is not supported: use torch.bfloat16, torch.float16 or torch.float32")
    check_weights_fit(cfg, device, dtype, nvfp4_experts=options.quantize_experts or cfg.quant is not None,
                      ep_size=options.ep_size)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV3ForCausalLM(cfg, attn_backend=options.attn_backend, attn_config=options.attn_config)
    finally:
        torch.set_default_dtype(prev)
    _Loader(model, cfg, source, device, dtype, options).run()
    model.post_load()
    return model.eval()


# ---------------------------------------------------------------------------------------------


class _Loader:
    def __init__(self, model, cfg: ModelConfig, source: TensorSource, device, dtype, options: LoadOptions):
        self.model, self.cfg, self.src, self.device, self.dtype, self.opt = model, cfg, source, device, dtype, options
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.expected = checkpoint_shapes(cfg)
        self.quant = cfg.quant

    def run(self) -> None:
        names = list(self.src.keys())
        present = set(names)
        seen: set[str] = set()
        experts: dict[int, dict[tuple[int, str], dict[str, str]]] = defaultdict(dict)
        skipped_mtp: set[int] = set()
        dequantized = 0
        for name in names:
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= self.cfg.num_hidden_layers:
                skipped_mtp.add(int(m.group(1)))
                continue
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            e = _EXPERT_RE.match(name)
            if e:
                layer, idx, proj, kind = int(e.group(1)), int(e.group(2)), e.group(3), e.group(4)
                base = name[: -len(kind) - 1] + ".weight"
                if base not in self.expected:
                    self._unexpected(name)
                experts[layer].setdefault((idx, proj), {})[kind] = name
                continue
            if name.endswith(tuple("." + a for a in _QUANT_AUX)):
                base = name.rsplit(".", 1)[0] + ".weight"
                if base not in present:
                    self._unexpected(name)
                continue  # read together with its weight
            if name not in self.expected:
                self._unexpected(name)
            dequantized += self._load_dense(name, present)
            seen.add(name)
        if skipped_mtp:
            log.info("skipped checkpoint layers %s (multi-token-prediction module; pdlab does not run it)",
                     sorted(skipped_mtp))
        for layer, block in enumerate(self.model.model.layers):
            if isinstance(block.mlp, MoEBlock):
                block.mlp.set_experts(self._experts(layer, experts.get(layer, {})), runner=self.opt.moe_runner,
                                      dispatcher=self.opt.dispatcher, decode_mode=self.opt.moe_decode_mode,
                                      ep_size=self.opt.ep_size, ep_rank=self.opt.ep_rank, group=self.opt.ep_group,
                                      **self.opt.moe_kwargs)
                seen.update(n for n in self.expected if n.startswith(f"model.layers.{layer}.mlp.experts."))
        missing = [n for n in self.expected if n not in seen]
        if missing:
            raise CheckpointError(f"{len(missing)} tensor(s) missing from {self.src.where(missing[0])}: "
                                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                                  "(the config.json does not match these weights, or shards are missing)")
        if dequantized:
            log.info("dequantized %d NVFP4 linear layer(s) outside the experts to %s at load", dequantized,
                     str(self.dtype).replace("torch.", ""))

    def _unexpected(self, name: str) -> None:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            raise CheckpointError(f"unexpected tensor 'lm_head.weight' in {self.src.where(name)}: config.json sets "
                                  "tie_word_embeddings true (the head reuses embed_tokens), yet the checkpoint has its "
                                  "own head; set tie_word_embeddings to false in config.json")
        raise CheckpointError(f"unexpected tensor {name!r} in {self.src.where(name)}: pdlab's DeepseekV3 has no "
                              "such parameter (a different architecture, or a config.json with fewer layers/"
                              "experts than the weights)")

    def _check(self, name: str, got: tuple, want: tuple, what: str = "") -> None:
        if tuple(got) != tuple(want):
            raise CheckpointError(f"tensor {name!r} in {self.src.where(name)} has shape {list(got)} but the config "
                                  f"expects {list(want)}{what}")

    def _read_linear(self, name: str, present: set[str]) -> tuple[torch.Tensor, bool]:
        """A weight as a float tensor (NVFP4 dequantized when its scales are present)."""
        t = self.src.get(name)
        want = self.expected[name]
        scale_name = name[: -len("weight")] + "weight_scale"
        if t.dtype == torch.uint8 and scale_name in present:
            from pdlab.kernels.nvfp4 import dequantize_nvfp4

            self._check(name, t.shape, (*want[:-1], want[-1] // 2), " (NVFP4 packed: K/2 bytes per row)")
            scale_2 = self.src.get(name + "_scale_2").float()
            w = dequantize_nvfp4(t, self.src.get(scale_name), 1.0 / scale_2, dtype=torch.float32)
            return w, True
        self._check(name, t.shape, want)
        if t.dtype in _FP8_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.src.where(name)} is {t.dtype}: FP8 weights are not "
                                  "supported (load a bf16 checkpoint, or a modelopt NVFP4 one)")
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r} in {self.src.where(name)} is {t.dtype}, expected a float "
                                  "tensor (a quantized weight without its weight_scale?)")
        return t, False

    def _load_dense(self, name: str, present: set[str]) -> int:
        t, was_quantized = self._read_linear(name, present)
        target, rows = name, None
        for proj, part in (("gate_proj", 0), ("up_proj", 1)):
            if name.endswith(f".mlp.{proj}.weight") or name.endswith(f".shared_experts.{proj}.weight"):
                target = name.replace(f"{proj}.weight", "gate_up_proj.weight")
                n = t.shape[0]
                rows = slice(part * n, (part + 1) * n)
        param = self.params.get(target)
        if param is None:
            self._unexpected(name)
        dst = param.data if rows is None else param.data[rows]
        dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
        return int(was_quantized)

    def _experts(self, layer: int, found: dict[tuple[int, str], dict[str, str]]):
        from pdlab.moe.weights import ExpertWeights, quantize_in_chunks

        E = self.cfg.n_routed_experts
        missing = [f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for e in range(E)
                   for p in ("gate_proj", "up_proj", "down_proj") if "weight" not in found.get((e, p), {})]
        if missing:
            raise CheckpointError(f"{len(missing)} expert tensor(s) missing from {self.src.where(missing[0])}: "
                                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        first = self.src.get(found[(0, "gate_proj")]["weight"])
        if first.dtype == torch.uint8:
            return ExpertWeights.from_modelopt(self._stack_modelopt(layer, found))
        if not self.opt.quantize_experts:
            return ExpertWeights.from_bf16(*self._bf16_experts(found, range(E)), quantize=False)
        # Quantizing at load goes EXPERT_CHUNK experts at a time, so a full-width layer never holds
        # all its bf16 experts (and their fp32 quantization temporaries) at once.
        return quantize_in_chunks(lambda e0, n: self._bf16_experts(found, range(e0, e0 + n)), E, EXPERT_CHUNK)

    def _bf16_experts(self, found, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts `experts` of a bf16/fp32 checkpoint → (w13 [e, 2I, H], w2 [e, H, I]) on the device."""
        inter, H = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        w13 = torch.empty(len(experts), 2 * inter, H, dtype=self.dtype, device=self.device)
        w2 = torch.empty(len(experts), H, inter, dtype=self.dtype, device=self.device)
        for i, e in enumerate(experts):
            for proj, dst in (("gate_proj", w13[i, :inter]), ("up_proj", w13[i, inter:]), ("down_proj", w2[i])):
                name = found[(e, proj)]["weight"]
                t = self.src.get(name)
                self._check(name, t.shape, self.expected[name])
                if t.dtype in _FP8_DTYPES or not t.is_floating_point():
                    raise CheckpointError(f"expert tensor {name!r} in {self.src.where(name)} is {t.dtype}: experts "
                                          "load from bf16/fp32 or modelopt NVFP4 (uint8 + scales) tensors")
                dst.copy_(t.to(device=self.device, dtype=self.dtype))
        return w13, w2

    def _stack_modelopt(self, layer: int, found) -> dict[str, torch.Tensor]:
        """Per-expert modelopt tensors → the stacked names `ExpertWeights.from_modelopt` takes:
        w13_* = gate rows then up rows ([E, 2I, H/2], [E, 2I, H/16], scale_2 / input scale [E, 2]),
        w2_* = down ([E, H, I/2], [E, H, I/16], [E])."""
        E, H, inter = self.cfg.n_routed_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        want = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
        parts: dict[str, dict[str, list[torch.Tensor]]] = {p: defaultdict(list) for p in want}
        for e in range(E):
            for proj, (n, k) in want.items():
                entry = found[(e, proj)]
                lacking = [a for a in ("weight", "weight_scale", "weight_scale_2") if a not in entry]
                if lacking:
                    base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    raise CheckpointError(f"NVFP4 expert {base} lacks {', '.join(base + '.' + a for a in lacking)} "
                                          f"in {self.src.where(entry['weight'])}")
                for kind, shape in (("weight", (n, k // 2)), ("weight_scale", (n, k // 16)),
                                    ("weight_scale_2", None), ("input_scale", None)):
                    if kind not in entry:
                        continue
                    t = self.src.get(entry[kind])
                    if shape is not None:
                        self._check(entry[kind], t.shape, shape, " (NVFP4 layout)")
                    elif t.numel() != 1:
                        self._check(entry[kind], t.shape, (), " (one fp32 scale per tensor)")
                    parts[proj][kind].append(t.reshape(shape) if shape else t.reshape(()).float())
        dev = self.device

        def stacked(proj: str, kind: str) -> torch.Tensor | None:
            ts = parts[proj][kind]
            return torch.stack(ts).to(dev) if len(ts) == E else None

        out: dict[str, torch.Tensor] = {
            "w13_weight": torch.cat([stacked("gate_proj", "weight"), stacked("up_proj", "weight")], dim=1),
            "w13_weight_scale": torch.cat([stacked("gate_proj", "weight_scale"),
                                           stacked("up_proj", "weight_scale")], dim=1),
            "w13_weight_scale_2": torch.stack([stacked("gate_proj", "weight_scale_2"),
                                               stacked("up_proj", "weight_scale_2")], dim=1),
            "w2_weight": stacked("down_proj", "weight"),
            "w2_weight_scale": stacked("down_proj", "weight_scale"),
            "w2_weight_scale_2": stacked("down_proj", "weight_scale_2"),
        }
        g_in, u_in, d_in = (stacked(p, "input_scale") for p in ("gate_proj", "up_proj", "down_proj"))
        if g_in is not None and u_in is not None:
            out["w13_input_scale"] = torch.stack([g_in, u_in], dim=1)
        if d_in is not None:
            out["w2_input_scale"] = d_in
        return out
