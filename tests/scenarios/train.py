"""One training run of a model other people wrote, recorded on CPU with memdiff's profiler route.

    python tests/scenarios/train.py --model bert --out run.pickle [--batch 8] [--autocast] ...

Models are built from small configs (Hugging Face GPT-2, BERT and Llama; plain torch.nn MLP and
CNN), with everything seeded, and the model and optimizer made before recording starts, as a
training script does. The flags are the changes teams make to a training loop; see
tests/scenarios/README.md. With --truth FILE the run also writes, for each trace entry, the
step and phase it happened in, read from record_function scopes that the script opens: the
ground truth memdiff's own step and phase inference is checked against.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from memdiff.recording.capture import record

# What `--jobs -` writes on stdout after each run it recorded (tests/scenario_suite.py waits for it).
DONE = "scenario-suite: recorded"

VOCAB = 1000
POSITIONS = 128
HF_TEXT = ("gpt2", "bert", "llama", "t5", "mixtral", "neox", "distilbert", "bart", "qwen2")
MODELS = (*HF_TEXT, "vit", "convnext", "lstm", "mlp", "cnn", "gpt", "tenc")


def hf_model(name: str, vocab: int = VOCAB, positions: int = POSITIONS,
             full: bool = False) -> Tuple[nn.Module, List[nn.Module], int]:
    """(model, its transformer layers, hidden size) of a small Hugging Face model; with `full`,
    GPT-2 from the library's default config (124M weights)."""
    import transformers as hf

    if name == "gpt2" and full:
        model = hf.GPT2LMHeadModel(hf.GPT2Config())
        return model, list(model.transformer.h), model.config.n_embd
    if name == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=vocab,
                                                 n_positions=positions))
        return model, list(model.transformer.h), 128
    if name == "bert":
        model = hf.BertForSequenceClassification(hf.BertConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=vocab,
            max_position_embeddings=positions))
        return model, list(model.bert.encoder.layer), 128
    if name == "t5":
        model = hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=vocab, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0))
        # Both stacks' layers: what gradient checkpointing wraps, encoder then decoder.
        return model, [*model.encoder.block, *model.decoder.block], 128
    if name == "mixtral":
        model = hf.MixtralForCausalLM(hf.MixtralConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=vocab, max_position_embeddings=positions))
        return model, list(model.model.layers), 128
    if name == "neox":
        model = hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=vocab,
            max_position_embeddings=positions))
        return model, list(model.gpt_neox.layers), 128
    if name == "bart":
        model = hf.BartForConditionalGeneration(hf.BartConfig(
            vocab_size=vocab, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=positions))
        return model, list(model.model.encoder.layers), 128
    if name == "distilbert":
        model = hf.DistilBertForSequenceClassification(hf.DistilBertConfig(
            n_layers=2, dim=128, n_heads=4, hidden_dim=512, vocab_size=vocab, max_position_embeddings=positions))
        return model, list(model.distilbert.transformer.layer), 128
    if name == "convnext":
        model = hf.ConvNextForImageClassification(hf.ConvNextConfig(
            num_channels=3, patch_size=4, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10,
            image_size=32))
        return model, [stage.layers[0] for stage in model.convnext.encoder.stages], 32
    if name == "vit":
        model = hf.ViTForImageClassification(hf.ViTConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512, image_size=32,
            patch_size=4, num_labels=10))
        return model, list(model.vit.layers), 128
    if name == "qwen2":
        # Llama's layout with biased query, key and value projections, and the output head tied to the
        # embedding, as Qwen2-0.5B and 1.5B have it.
        model = hf.Qwen2ForCausalLM(hf.Qwen2Config(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
            vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=True))
        return model, list(model.model.layers), 128
    model = hf.LlamaForCausalLM(hf.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
        vocab_size=vocab, max_position_embeddings=positions))
    return model, list(model.model.layers), 128


class MLP(nn.Module):
    """A plain classifier: three hidden layers, GELU and dropout."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(256, width), nn.Linear(width, width), nn.Linear(width, width)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, 10)
        self.checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(lambda t, f=layer: self.drop(nn.functional.gelu(f(t))), x,
                                                      use_reentrant=False)
            else:
                x = self.drop(nn.functional.gelu(layer(x)))
        return self.head(x)


class LSTM(nn.Module):
    """A two-layer nn.LSTM language model over token ids."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)
        self.layers = [self.rnn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


class TransformerEncoderLM(nn.Module):
    """torch.nn.TransformerEncoder's layers (its defaults: post-norm, ReLU, dropout 0.1) over token
    ids, called one by one as a script that checkpoints some of them does."""

    def __init__(self, hidden: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, batch_first=True),
                                             layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, VOCAB)
        self.checkpointed: Set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for k, layer in enumerate(self.encoder.layers):
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False) if k in self.checkpointed else layer(h)
        return self.head(h)


class CNN(nn.Module):
    """A small convolutional classifier for 3x32x32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)])
        self.norm = nn.BatchNorm2d(64)
        self.head = nn.Linear(64 * 8 * 8, 10)
        self.checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            step = lambda t, f=layer: nn.functional.max_pool2d(nn.functional.relu(f(t)), 2)  # noqa: E731
            x = torch.utils.checkpoint.checkpoint(step, x, use_reentrant=False) if self.checkpoint else step(x)
        return self.head(self.norm(x).flatten(1))


class LoRALinear(nn.Module):
    """A frozen nn.Linear with a trainable low-rank update, as LoRA adapters add it:
    y = base(x) + (x A^T) B^T * alpha / r, B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def add_lora(model: nn.Module, layers: List[nn.Module], rank: int) -> None:
    """Freeze every weight of the model, then give each nn.Linear of its layers a LoRA adapter."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers:
        for name, child in list(layer.named_modules()):
            for attr, sub in list(child.named_children()):
                if isinstance(sub, nn.Linear):
                    setattr(child, attr, LoRALinear(sub, rank))


def build(args: argparse.Namespace) -> Tuple[nn.Module, List[nn.Module], int, Callable[[], Dict[str, torch.Tensor]],
                                            Callable[[nn.Module, Dict[str, torch.Tensor]], torch.Tensor]]:
    """(model, its layers, hidden size, a batch maker, the loss of a batch)."""
    b, s = args.batch, args.seq
    if args.model in HF_TEXT:
        vocab = args.vocab
        model, layers, hidden = hf_model(args.model, vocab, args.positions, args.config == "full")
        classify = args.model in ("bert", "distilbert")
        labels = (lambda: torch.randint(0, 2, (b,))) if classify else (lambda: torch.randint(0, vocab, (b, s)))

        lengths = random.Random(args.lengths_seed) if args.lengths_seed is not None else None

        def batch() -> Dict[str, torch.Tensor]:
            if lengths is not None:  # data-dependent memory: each batch its own sequence length
                n = lengths.randint(s // 2, s)
                return {"input_ids": torch.randint(1, vocab, (b, n)), "labels": torch.randint(0, vocab, (b, n))}
            x = {"input_ids": torch.randint(1, vocab, (b, s)), "labels": labels()}
            if args.model in ("t5", "bart"):  # the decoder reads half as many tokens as the encoder
                x["labels"] = torch.randint(1, vocab, (b, s // 2))
            return x
        return model, layers, hidden, batch, lambda m, x: m(**x).loss
    if args.model in ("vit", "convnext"):
        model, layers, hidden = hf_model(args.model)

        def images() -> Dict[str, torch.Tensor]:
            return {"pixel_values": torch.randn(b, 3, 32, 32), "labels": torch.randint(0, 10, (b,))}
        return model, layers, hidden, images, lambda m, x: m(**x).loss
    if args.model == "gpt":  # memdiff's own example GPT: small, quick for torch.compile to compile
        from memdiff.examples.gpt import GPT, Config

        gpt = GPT(Config(n_layer=1, n_head=2, n_embd=64, vocab_size=512, block_size=128))

        def ids() -> Dict[str, torch.Tensor]:
            return {"idx": torch.randint(0, 512, (b, s)), "targets": torch.randint(0, 512, (b, s))}
        return gpt, list(gpt.blocks), 64, ids, lambda m, x: m(x["idx"], x["targets"])
    if args.model == "tenc":
        tenc = TransformerEncoderLM()

        def sequences() -> Dict[str, torch.Tensor]:
            return {"x": torch.randint(0, VOCAB, (b, s)), "y": torch.randint(0, VOCAB, (b, s))}
        return (tenc, list(tenc.encoder.layers), 128, sequences,
                lambda m, x: nn.functional.cross_entropy(m(x["x"]).flatten(0, 1), x["y"].flatten()))
    if args.model == "lstm":
        lstm = LSTM()

        def tokens() -> Dict[str, torch.Tensor]:
            return {"x": torch.randint(0, VOCAB, (b, s)), "y": torch.randint(0, VOCAB, (b, s))}
        return (lstm, [lstm.rnn], 128, tokens,
                lambda m, x: nn.functional.cross_entropy(m(x["x"]).flatten(0, 1), x["y"].flatten()))
    model = MLP() if args.model == "mlp" else CNN()
    shape = (b, 256) if args.model == "mlp" else (b, 3, 32, 32)
    hidden = 512 if args.model == "mlp" else 32

    def batch() -> Dict[str, torch.Tensor]:
        return {"x": torch.randn(*shape), "y": torch.randint(0, 10, (b,))}
    return (model, list(model.layers)[:2] if args.model == "mlp" else list(model.layers)[:1], hidden, batch,
            lambda m, x: nn.functional.cross_entropy(m(x["x"]), x["y"]))


def add_debug_projections(layers: List[nn.Module], hidden: int) -> Tuple[List[nn.Module], List[torch.Tensor]]:
    """The seed's bug: an abandoned Linear(hidden, 4*hidden) per layer, applied to each layer's
    output and tied into the loss. Returns the projections and the list their outputs go to."""
    projections, outputs = [], []
    for layer in layers:
        proj = nn.Linear(hidden, 4 * hidden)
        projections.append(proj)

        def hook(_module: nn.Module, _inputs: Any, out: Any, proj: nn.Module = proj) -> None:
            h = out[0] if isinstance(out, tuple) else out
            if h.dim() == 4:  # a CNN feature map: project its channels
                h = h.mean(dim=(2, 3))
            outputs.append(proj(h))
        layer.register_forward_hook(hook)
    return projections, outputs


def on_device(batch: Callable[[], Dict[str, torch.Tensor]], device: str) -> Callable[[], Dict[str, torch.Tensor]]:
    """The batch maker, its tensors copied to `device` as a data loader's batches are."""
    if device == "cpu":
        return batch
    return lambda: {k: v.to(device) for k, v in batch().items()}


@contextlib.contextmanager
def scope(name: str, on: bool) -> Iterator[None]:
    """A record_function scope when the run writes ground truth; nothing otherwise."""
    if not on:
        yield
        return
    with torch.profiler.record_function(name):
        yield


def make_optimizer(name: str, params: List[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adamw-amsgrad":
        return torch.optim.AdamW(params, lr=1e-3, amsgrad=True)
    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if name == "adagrad":  # makes its state (one sum per weight) in its constructor
        return torch.optim.Adagrad(params, lr=1e-2)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9 if name == "sgd-momentum" else 0.0)


def setup(args: argparse.Namespace) -> Tuple[nn.Module, List[nn.Parameter], torch.optim.Optimizer, List[torch.Tensor],
                                             Callable[[], Dict[str, torch.Tensor]], Callable[..., torch.Tensor]]:
    """(model, trainable parameters, optimizer, debug outputs, batch maker, loss of a batch)."""
    torch.manual_seed(0)
    model, layers, hidden, batch, loss_of = build(args)
    model.to(args.device)
    batch = on_device(batch, args.device)
    if args.bf16 or args.fp16:
        half = torch.bfloat16 if args.bf16 else torch.float16
        model.to(half)
        make = batch

        def batch() -> Dict[str, torch.Tensor]:
            return {k: v.to(half) if v.is_floating_point() else v for k, v in make().items()}
    if args.freeze:
        frozen = [p for name, p in model.named_parameters() if "embed" in name or "wte" in name or "wpe" in name]
        for layer in layers[: max(1, len(layers) // 2)]:
            frozen += list(layer.parameters())
        for p in frozen:
            p.requires_grad_(False)
    if args.freeze_encoder:
        # The pretrained body (embeddings, every layer, BERT's pooler) frozen: only the task head trains.
        for p in model.base_model.parameters():
            p.requires_grad_(False)
    if args.lora:
        add_lora(model, layers, args.lora)
        model.to(args.device)
    if args.checkpoint or args.checkpoint_fraction:
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
            if args.checkpoint_fraction:
                # Every 1/F-th layer keeps checkpointing (0.5: the second, fourth, ...), as memdiff whatif's
                # checkpoint=F picks them.
                f = args.checkpoint_fraction
                for k, layer in enumerate(layers):
                    layer.gradient_checkpointing = int((k + 1) * f) > int(k * f)
        elif isinstance(model, TransformerEncoderLM):
            f = args.checkpoint_fraction or 1.0
            model.checkpointed = {k for k in range(len(layers)) if int((k + 1) * f) > int(k * f)}
        else:
            model.checkpoint = True
    projections, extra = add_debug_projections(layers, hidden) if args.debug_projections else ([], [])
    for proj in projections:
        proj.to(args.device)
    params = [p for p in model.parameters() if p.requires_grad] + [p for m in projections for p in m.parameters()]
    opt = make_optimizer(args.optimizer, params)
    model.train()
    if args.compile:
        # As a fresh process compiles: no graph from an earlier job of --jobs, no dynamic shapes.
        torch._dynamo.reset()
        model = torch.compile(model)  # type: ignore[assignment]
        # Compiled before recording, as a training script's first step does: a forward and a
        # backward, without an optimizer step (its state would be older than the trace).
        loss_of(model, batch()).backward()
        for p in params:
            p.grad = None
    return model, params, opt, extra, batch, loss_of


def write_facts(args: argparse.Namespace, model: nn.Module, opt: Optional[torch.optim.Optimizer],
                extra: Optional[Dict[str, Any]] = None) -> None:
    """Facts from the model and optimizer, for the tests to check memdiff against (never memdiff's
    own output): bytes of the weights and buffers, of the trainable weights, of the optimizer's state tensors and
    how many each weight has, steps recorded."""
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()
    state = [v for per in (opt.state.values() if opt else []) for v in per.values() if isinstance(v, torch.Tensor)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Buffers can share storage (Mixtral's rotary inv_freq and original_inv_freq): count each once.
    tensors = {t.untyped_storage().data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    facts = {"parameter_bytes": sum(t.untyped_storage().nbytes() for t in tensors.values()),
             "trainable_bytes": sum(nbytes(p) for p in trainable),
             "state_bytes": sum(nbytes(t) for t in state),
             "state_scalar_bytes": sum(nbytes(t) for t in state if t.numel() == 1),
             "state_tensors_per_parameter": sorted({len(per) for per in opt.state.values()}) if opt else [],
             "steps": args.steps, **(extra or {})}
    with open(args.out + ".facts.json", "w") as f:
        json.dump(facts, f)


def generate(args: argparse.Namespace) -> None:
    """Inference: greedy generate() calls, each with a fresh prompt."""
    torch.manual_seed(0)
    model, _, _, batch, _ = build(args)
    model.to(args.device).eval()
    batch = on_device(batch, args.device)
    with record(args.out, stacks=args.stacks), torch.no_grad():
        for _ in range(args.steps):
            model.generate(input_ids=batch()["input_ids"][:, :16], max_new_tokens=8, do_sample=False,
                           pad_token_id=0)
    write_facts(args, model, None)


def infer(args: argparse.Namespace) -> None:
    """Inference: forwards in eval mode under torch.no_grad(), no backward, no optimizer step."""
    torch.manual_seed(0)
    model, _, _, batch, loss_of = build(args)
    model.to(args.device).eval()
    batch = on_device(batch, args.device)
    truth = bool(args.truth)
    with record(args.out, stacks=args.stacks), torch.no_grad():
        for step in range(args.steps):
            with scope(f"ProfilerStep#{step}", truth), scope("## forward ##", truth):
                out = loss_of(model, batch())
                del out
    write_facts(args, model, None)


def train(args: argparse.Namespace) -> None:
    if args.generate:
        generate(args)
        return
    if args.inference:
        infer(args)
        return
    built = None if args.inside else setup(args)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
    truth = bool(args.truth)
    logged: List[Any] = []
    kept_weights: List[List[torch.Tensor]] = []
    ema: List[torch.Tensor] = []
    ema_before: List[torch.Tensor] = []
    kept_eval = None
    val = None  # the last validation loss: the loop's variable, held until the next one replaces it
    total: Any = 0.0  # --sum-loss: the training losses summed as tensors (their graphs freed by backward())

    def one_step(step: int, model: nn.Module, params: List[nn.Parameter], opt: torch.optim.Optimizer,
                 extra: List[torch.Tensor], batch: Callable[[], Dict[str, torch.Tensor]],
                 loss_of: Callable[..., torch.Tensor]) -> None:
        nonlocal kept_eval, val, total
        with scope(f"ProfilerStep#{step}", truth):
            if args.zero_grad == "first":
                with scope("## optimizer ##", truth):
                    opt.zero_grad(set_to_none=not args.keep_grads)
            for _ in range(args.accum):
                with scope("## forward ##", truth):
                    x = batch()
                    with autocast:
                        loss = loss_of(model, x) / args.accum
                        if extra:
                            loss = loss + 1e-3 * sum(p.float().mean() for p in extra)
                            extra.clear()
                if args.zero_grad == "before-backward":
                    with scope("## optimizer ##", truth):
                        opt.zero_grad(set_to_none=not args.keep_grads)
                with scope("## backward ##", truth):
                    loss.backward(retain_graph=args.retain_graph)
                if args.sum_loss:
                    total += loss
            if args.keep_weights:
                # The leak: weight copies kept each step, made between backward() and step().
                kept_weights.append([p.detach().clone() for p in params])
            with scope("## optimizer ##", truth):
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                if args.zero_grad == "after":
                    opt.zero_grad(set_to_none=not args.keep_grads)
            if args.ema:
                with torch.no_grad():
                    if not ema:
                        ema.extend(p.detach().clone() for p in params)
                    else:
                        torch._foreach_lerp_(ema, [p.detach() for p in params], 1e-3)
            if ema_before:
                with torch.no_grad():
                    for e, p in zip(ema_before, params):
                        e.mul_(0.999).add_(p.detach(), alpha=1e-3)
            if args.log_loss != "none":
                # A validation loss each step: logged as a tensor, it keeps its whole graph.
                with scope("## forward ##", truth):
                    val = loss_of(model, batch())
                logged.append(val if args.log_loss == "tensor" else val.item())
            if args.eval != "none":
                with scope("## forward ##", truth):
                    # Without torch.no_grad() the evaluation's graph lives on until the next one.
                    with torch.no_grad() if args.eval == "no-grad" else contextlib.nullcontext():
                        kept_eval = loss_of(model, batch())
            if not args.keep_loss:
                del loss, x

    def validate(model: nn.Module, batch: Callable[[], Dict[str, torch.Tensor]],
                 loss_of: Callable[..., torch.Tensor]) -> None:
        """A validation loop as teams write it: the batches' losses summed with `+=`; without
        torch.no_grad() (--val-grad) each loss keeps its batch's graph alive until the sum goes.
        Writes the facts of each batch's graph: bytes its saved tensors hold apart from the weights."""
        weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved: List[int] = []
        seen: set = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved[-1] += storage.nbytes()
            return t
        val_loss: Any = 0.0
        with torch.no_grad() if not args.val_grad else contextlib.nullcontext(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for _ in range(args.val_batches):
                saved.append(0)
                with scope("## forward ##", truth):
                    val_loss += loss_of(model, batch())
        print(f"validation loss {float(val_loss) / args.val_batches:.3f}")
        val_facts["val_saved_bytes"] = saved

    val_facts: Dict[str, Any] = {}
    averaged = None
    if built is not None:
        for _ in range(args.warmup):  # warm-up steps before recording: the state is made here
            one_step(-1, *built)
        if args.ema_before:
            ema_before.extend(p.detach().clone() for p in built[1])
        if args.ema_averaged:
            # torch.optim.swa_utils: a deepcopy of the model, updated with a lerp after each step.
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
            averaged = AveragedModel(built[0], multi_avg_fn=get_ema_multi_avg_fn(0.999))
    if args.device == "cuda":
        # The allocator's own high-water mark over the recording: a truth for the snapshot's peak
        # that is PyTorch's count, not memdiff's reading of the trace.
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with record(args.out, stacks=args.stacks):
        if built is None:
            # As a test does: the model and optimizer made inside the recording, freed on return.
            inside = setup(args)
            for step in range(args.steps):
                one_step(step, *inside)
            write_facts(args, inside[0], inside[2])
            del inside
            ema.clear()
        else:
            for step in range(args.steps):
                one_step(step, *built)
                if averaged is not None:
                    averaged.update_parameters(built[0])
            if args.val_batches:
                validate(built[0], built[4], built[5])
    if averaged is not None:
        copies = {t.untyped_storage().data_ptr(): t for t in [*averaged.parameters(), *averaged.buffers()]}
        val_facts["ema_bytes"] = sum(t.untyped_storage().nbytes() for t in copies.values())
    if args.device == "cuda":
        val_facts["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if built is not None:
        write_facts(args, built[0], built[2], val_facts)
    del kept_eval


def record_truth(path: Optional[str]) -> None:
    """Make the profiler route also write, per trace entry, (step, phase) from the script's scopes
    (or, with None, stop doing so).

    memdiff's CPU route converts the profiler's memory timeline with
    torch.cuda._memory_viz._profile_to_snapshot, which drops times. This wraps it to replay the
    timeline in the converter's own order (create: 1 entry, destroy: 2, new version: 3,
    preexisting: none) and so learn each entry's time, then looks the time up in the
    record_function scopes of the op tree, which run on the same clock.
    """
    from torch._C._profiler import _EventType
    from torch.cuda import _memory_viz
    from torch.profiler._memory_profiler import Action, TensorKey

    convert = getattr(_memory_viz._profile_to_snapshot, "converts", _memory_viz._profile_to_snapshot)
    if path is None:
        _memory_viz._profile_to_snapshot = convert
        return

    def converted(profile: Any) -> Dict[str, Any]:
        snapshot = convert(profile)
        memory = profile._memory_profile()
        times: List[int] = []
        for t, action, (key, _version), _size in memory.timeline:
            if isinstance(key, TensorKey):
                times += [t] * {Action.CREATE: 1, Action.DESTROY: 2, Action.INCREMENT_VERSION: 3}.get(action, 0)
        trace = snapshot["device_traces"][-1]
        if len(times) != len(trace):
            raise SystemExit(f"ground truth: {len(times)} timed entries for {len(trace)} trace entries")
        scopes = [(n.start_time_ns, n.end_time_ns, n.name) for n in memory._op_tree.sorted_nodes
                  if n.typed[0] == _EventType.TorchOp and (n.name.startswith("## ") or n.name.startswith("ProfilerStep#"))]
        rows = []
        for t in times:
            inside = [(start, name) for start, end, name in scopes if start <= t <= end]
            step = next((int(name.split("#")[1]) for _, name in inside if name.startswith("ProfilerStep#")), None)
            phases = sorted((start, name.strip("# ")) for start, name in inside if name.startswith("## "))
            rows.append([step, phases[-1][1] if phases else None])
        with open(path, "w") as f:
            json.dump({"entries": rows}, f)
        return snapshot

    converted.converts = convert  # type: ignore[attr-defined]
    _memory_viz._profile_to_snapshot = converted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--out", help="snapshot to write")
    p.add_argument("--truth", help="also write per-entry (step, phase) ground truth to this JSON file")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--optimizer", choices=("adamw", "adam", "adamw-amsgrad", "adamw-foreach", "adamw-fused", "adagrad", "sgd",
                                           "sgd-momentum", "rmsprop", "adafactor"), default="adamw")
    p.add_argument("--warmup", type=int, default=0, help="steps run before recording starts")
    p.add_argument("--ema", action="store_true", help="an EMA copy of the weights, made in the first step")
    p.add_argument("--ema-before", action="store_true",
                   help="an EMA copy of the weights made before recording (as copy.deepcopy(model) does), "
                        "updated after each step with mul_ and add_")
    p.add_argument("--ema-averaged", action="store_true",
                   help="an EMA made before recording with torch.optim.swa_utils.AveragedModel, updated after each step")
    p.add_argument("--val-batches", type=int, default=0,
                   help="a validation loop after the steps: this many batches, their losses summed with +=")
    p.add_argument("--val-grad", action="store_true",
                   help="the validation loop without torch.no_grad(): each batch's graph lives until the sum goes")
    p.add_argument("--sum-loss", action="store_true",
                   help="the training losses summed with += as tensors, after backward() (which frees their graphs)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="freeze the model and train LoRA adapters of this rank on the nn.Linear of its layers")
    p.add_argument("--clip", action="store_true", help="clip_grad_norm_ before each step")
    p.add_argument("--retain-graph", action="store_true", help="backward(retain_graph=True)")
    p.add_argument("--zero-grad", choices=("after", "first", "before-backward"), default="after",
                   help="zero_grad after the optimizer step, first thing in each step, or between forward and backward")
    p.add_argument("--keep-grads", action="store_true", help="zero_grad(set_to_none=False)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (model.to(torch.bfloat16))")
    p.add_argument("--fp16", action="store_true", help="fp16 weights (model.to(torch.float16))")
    p.add_argument("--generate", action="store_true", help="inference: generate() instead of training")
    p.add_argument("--keep-weights", action="store_true",
                   help="the leak: copies of the weights appended to a list between backward() and step()")
    p.add_argument("--keep-loss", action="store_true", help="an ordinary loop: loss and batch live into the next step")
    p.add_argument("--inside", action="store_true",
                   help="model and optimizer made inside the recording and freed before it ends, as in a test")
    p.add_argument("--autocast", action="store_true", help="bf16 autocast")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    p.add_argument("--checkpoint-fraction", type=float,
                   help="checkpoint only this fraction of the Hugging Face models' layers (0.5: every other one)")
    p.add_argument("--freeze", action="store_true", help="freeze the embeddings and the lower half of the layers")
    p.add_argument("--freeze-encoder", action="store_true",
                   help="freeze the Hugging Face model's whole body (embeddings and every layer): only its head trains")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation: micro-batches per optimizer step")
    p.add_argument("--log-loss", choices=("none", "item", "tensor"), default="none",
                   help="a validation loss each step, logged with .item() or as a tensor (the leak)")
    p.add_argument("--eval", choices=("none", "no-grad", "grad"), default="none",
                   help="an evaluation forward after each step, in torch.no_grad() or not (kept until the next)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (Inductor), compiled by one forward and backward before recording")
    p.add_argument("--debug-projections", action="store_true", help="an abandoned Linear(h, 4h) per layer")
    p.add_argument("--lengths-seed", type=int, default=None,
                   help="each batch's sequence length drawn from [seq/2, seq] by a generator with this seed (Hugging "
                        "Face text models): repeats of one loop whose memory depends on the data")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size of the Hugging Face models")
    p.add_argument("--positions", type=int, default=POSITIONS,
                   help="position embeddings of the Hugging Face models (at least --seq)")
    p.add_argument("--inference", action="store_true", help="eval-mode forwards under torch.no_grad() only")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs; on cuda memdiff records the caching allocator's history")
    p.add_argument("--config", choices=("small", "full"), default="small",
                   help="full: GPT-2 from the library's default GPT2Config (124M weights; give --vocab 50257)")
    p.add_argument("--stacks", choices=("all", "python"), default="all", help="CUDA stacks (memdiff record's option)")
    p.add_argument("--jobs", help="a JSON list of argument lists: record each in turn, in this one process; "
                                  f"'-': one JSON argument list per line of stdin, each answered by '{DONE} OUT' "
                                  "on stdout once recorded")
    args = p.parse_args()

    def run(job: argparse.Namespace) -> None:
        if not (job.model and job.out):
            p.error("--model and --out are required (or --jobs)")
        record_truth(job.truth)
        train(job)

    # Several runs in one process pay for importing torch and transformers once.
    if args.jobs == "-":
        for line in iter(sys.stdin.readline, ""):
            job = p.parse_args(json.loads(line))
            run(job)
            print(DONE, job.out, flush=True)
        return
    with open(args.jobs) if args.jobs else contextlib.nullcontext() as f:
        jobs = [p.parse_args(argv) for argv in json.load(f)] if f else [args]
    for job in jobs:
        run(job)


if __name__ == "__main__":
    main()
