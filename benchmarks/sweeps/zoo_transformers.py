"""Every architecture of transformers' causal-LM, sequence-to-sequence, image-classification, audio
classification and CTC auto mappings, built from its config class's defaults with two layers (in every
sub-config: text, vision, audio, encoder, decoder) and at most four experts, two per token: the cost of
an emulated step grows with its ops, not its tensors' sizes, so the widths stay the defaults.
A batch of two: 32 tokens, 2 x 16,000 audio samples, images at the config's size."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

from case import Case, Skip

LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
          "num_decoder_layers", "num_encoder_layers", "depth")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
# The auto mapping each kind of case reads, and its loss's inputs
KINDS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
         "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
         "MODEL_FOR_CTC_MAPPING_NAMES")


def _kept_layers(values: Dict[str, Any]) -> List[int]:
    """The layers a shrunk config keeps: the first of each kind `layer_types` names (a hybrid's attention
    and Mamba layers, sliding and full attention), else the first two."""
    kinds = values.get("layer_types")
    if not isinstance(kinds, list) or not kinds:
        return [0, 1]
    first = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    return first if len(first) > 1 else [0, 1][:len(kinds)]


def shrink(values: Dict[str, Any]) -> Dict[str, Any]:
    """A config's to_dict() with its first layers of each kind and at most four experts (two per token),
    in every sub-config; per-layer lists keep the kept layers' entries."""
    count = values.get("num_hidden_layers")
    keep = _kept_layers(values)
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if key in ("out_features", "out_indices"):
            continue  # a backbone's stages by their number: the defaults follow the layers
        if isinstance(value, dict):
            out[key] = shrink(value)
        elif isinstance(value, list) and isinstance(count, int) and count > len(keep) and len(value) == count:
            out[key] = [value[i] for i in keep]
        elif isinstance(value, bool) or not isinstance(value, int):
            out[key] = value
        elif key == "num_hidden_layers" and value > len(keep):
            out[key] = len(keep)
        elif key in LAYERS and value > 2:
            out[key] = 2
        elif key in EXPERTS and value > 4:
            out[key] = 4
        elif key in PER_TOKEN and value > 2:
            out[key] = 2
        else:
            out[key] = value
    return out


def small_config(transformers: Any, model_type: str) -> Any:
    """The model type's default config, shrunk (module docstring): made again from the shrunk values,
    so that what the config derives (layer_types, sub-configs) follows them."""
    default = transformers.AutoConfig.for_model(model_type)
    values = shrink(default.to_dict())
    for key in ("model_type", "transformers_version", "architectures"):
        values.pop(key, None)
    return type(default)(**values)


def _inputs(torch: Any, kind: str, config: Any, model: Any) -> Dict[str, Any]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = min(int(getattr(text, "vocab_size", None) or 1000), 1000)
    ids = torch.randint(4, vocab, (2, 32))
    if kind.startswith(("MODEL_FOR_CAUSAL", "MODEL_FOR_SEQ_TO_SEQ")):
        inputs = {"input_ids": ids, "labels": ids}
        if kind.startswith("MODEL_FOR_SEQ_TO_SEQ") and getattr(config, "decoder_start_token_id", None) is None:
            # the decoder's inputs given, as a loop does for a config that names no token to shift
            # the labels right with (T5's family as transformers 5 makes it from its defaults)
            inputs["decoder_input_ids"] = ids
        return inputs
    labels = torch.randint(0, 2, (2,))
    if kind == "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES":
        side = getattr(config, "image_size", 224)
        side = side[0] if isinstance(side, (list, tuple)) else side
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(2, channels, side, side), "labels": labels}
    if kind == "MODEL_FOR_CTC_MAPPING_NAMES":
        labels = torch.randint(1, min(int(getattr(config, "vocab_size", 32)), 32), (2, 8))
    if model.main_input_name == "input_features":
        bins = getattr(config, "num_mel_bins", 80)
        frames = getattr(config, "max_length", None) or getattr(config, "max_source_positions", 1500) * 2
        inputs = {"input_features": torch.randn(2, frames, bins).transpose(1, 2)
                  if model.config.model_type == "whisper" else torch.randn(2, frames, bins),
                  "labels": labels}
        if kind == "MODEL_FOR_CTC_MAPPING_NAMES":
            # a CTC loss needs each clip's length: Parakeet reads it from the mask it is given (None without)
            inputs["attention_mask"] = torch.ones(2, frames, dtype=torch.long)
        return inputs
    return {model.main_input_name: torch.randn(2, 16000), "labels": labels}


def _case(transformers: Any, torch: Any, kind: str, model_type: str, auto: Any) -> Case:
    holder: Dict[str, Any] = {}

    def build() -> Any:
        try:
            holder["config"] = config = small_config(transformers, model_type)
        except Exception as exc:  # noqa: BLE001 (the config class's own validation of the shrunk values)
            raise Skip(f"no small config: {exc}") from None
        return auto.from_config(config)

    def loss(model: Any) -> Any:
        return model(**_inputs(torch, kind, holder["config"], model)).loss
    return Case(f"{kind.split('_MAPPING')[0][len('MODEL_FOR_'):].lower()}/{model_type}", build, loss)


def cases() -> Iterator[Case]:
    """The zoo: each kind's architectures in the mapping's order."""
    import torch
    import transformers
    from transformers.models.auto import modeling_auto

    autos = {"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": transformers.AutoModelForCausalLM,
             "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": transformers.AutoModelForSeq2SeqLM,
             "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": transformers.AutoModelForImageClassification,
             "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES": transformers.AutoModelForAudioClassification,
             "MODEL_FOR_CTC_MAPPING_NAMES": transformers.AutoModelForCTC}
    for kind in KINDS:
        for model_type in getattr(modeling_auto, kind):
            yield _case(transformers, torch, kind, model_type, autos[kind])
