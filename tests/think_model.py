"""A tiny Qwen3 that thinks, with a known greedy output (shared by the worker and end-to-end tests).

SmolLM2's tokenizer with ``<think>`` and ``</think>`` added as single tokens (as Qwen3's vocabulary has them) and
a Qwen3-style chat template (``enable_thinking``: "auto" picks the ``qwen3`` reasoning parser; ``<tool_call>``:
"auto" picks the ``hermes`` tool-call parser). The weights make it a bigram model: every layer's output
projections are zero, so the last position's final hidden state is its token's embedding, and the LM head maps
each token of a chain to the next one by a wide margin: ``"\\n"`` (the end of the generation prompt) ->
``<think>`` -> ``Let`` -> `` me`` -> `` think`` -> ``</think>`` -> ``It`` -> `` is`` -> `` sunny`` -> ``.`` -> EOS.
Greedy, the model thinks "Let me think", closes its reasoning and answers "It is sunny."; under a grammar that
forbids the chain's next token (and from any token off the chain) its logits are small and random, never for a
token of the chain: what follows is the grammar's to decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

THINK_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
REASONING = "Let me think"
ANSWER = "It is sunny."
EOS = 2  # <|im_end|>


@dataclass(frozen=True)
class ThinkModel:
    folder: Path
    think: int  # the token id of <think>
    end_think: int  # the token id of </think>
    chain: tuple[int, ...]  # the greedy output after the generation prompt, up to and including </think>
    answer: tuple[int, ...]  # the rest of it, free: "It is sunny." and EOS


def make_think_model(folder: Path) -> ThinkModel:
    """Build the model in ``folder`` (config, safetensors, tokenizer with the chat template)."""
    import torch
    from tokenizers import AddedToken
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cbserve.frontend.text.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = THINK_TEMPLATE
    think, end_think = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    words = [tok(w, add_special_tokens=False)["input_ids"] for w in ("\n", "Let", " me", " think")]
    answer = [*tok(ANSWER, add_special_tokens=False)["input_ids"], EOS]
    if any(len(w) != 1 for w in words):
        raise ValueError(f"the chain's words must be single tokens, got {words}")
    chain = [words[0][0], think, *(w[0] for w in words[1:]), end_think, *answer]
    if len(set(chain)) != len(chain):
        raise ValueError(f"a bigram chain cannot repeat a token: {chain}")
    torch.manual_seed(0)
    hidden = 64
    cfg = Qwen3Config(vocab_size=49160, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False)  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        directions = torch.linalg.qr(torch.randn(hidden, hidden))[0].T[: len(chain) - 1]  # orthonormal rows
        emb = model.model.embed_tokens.weight
        emb -= (emb @ directions.T) @ directions  # off the chain, a token's logits for the chain's tokens are 0
        for k, (src, dst) in enumerate(zip(chain, chain[1:], strict=False)):
            model.model.embed_tokens.weight[src] = directions[k]
            model.lm_head.weight[dst] = 8.0 * directions[k]  # logit 64 after the final norm; the rest ~0.2
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return ThinkModel(folder, think, end_think, tuple(chain[1 : -len(answer)]), tuple(answer))
