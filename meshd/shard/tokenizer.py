"""Tokenizers: from the GGUF metadata or the Hugging Face directory, cached, with chat templates.

Rule: building a tokenizer from GGUF metadata takes seconds (transformers converts the vocabulary),
so the result is saved under the cache directory, keyed by the model fingerprint, and reloaded from
there on later starts.
"""

from __future__ import annotations

import os

from meshd.shard.artifact import Artifact, ArtifactError, cache_at


def load_tokenizer(artifact: Artifact):
    from transformers import AutoTokenizer

    if artifact.kind == "hf":
        return AutoTokenizer.from_pretrained(artifact.path)
    cached = cache_at(artifact.cache) / "tokenizers" / artifact.fingerprint[:32]
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it below
    if "tokenizer.ggml.tokens" not in artifact.metadata:
        raise ArtifactError(f"{artifact.name} carries no tokenizer (no tokenizer.ggml.* metadata);"
                            " the shard holding layer 0 needs one")
    tok = AutoTokenizer.from_pretrained(artifact.path.parent, gguf_file=artifact.path.name)
    tmp = cached.with_name(cached.name + f".{os.getpid()}.tmp")
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race; its copy is as good
        pass
    return tok


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids for a prompt; with `chat`, wrapped in the model's chat template as a user turn."""
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt).input_ids)


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    constrained: bool = False) -> list[int]:
    """Token ids for a conversation in the model's chat template, ready for the assistant's turn; `tools`
    (OpenAI tool definitions) rendered as the template renders them. `constrained`: a grammar holds the
    answer from its first token, so a template that can think first (Qwen3's `enable_thinking`) is asked
    not to (other templates ignore the flag)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt")
    extra = {"enable_thinking": False} if constrained else {}
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        **extra)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class TextStream:
    """Turns token ids into text pieces as they arrive, holding back incomplete UTF-8 sequences.

    Each push decodes a window, not the whole text so far (that cost O(n) a token: 0.17 ms at 1000
    tokens, 0.57 ms at 4000, on the daemon's event thread): the tokens from the
    start of the last emitted piece on, with and without the tokens not yet emitted; the piece is
    what the new ones add. Starting the window a piece back keeps what depends on the tokens before
    (a SentencePiece leading space, dropped at the start of a decode; a multi-byte character split
    across tokens) the same in both decodes. The pieces add up to the decode of all the ids. A window
    holding bytes that form no character (a model may sample any token) may split them into replacement
    characters otherwise than the whole decode does (found by the property test: ids 197, 131, 3, 131, 259):
    there the piece comes from the whole decode, as long as the window holds such bytes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids = tokenizer, []
        self.start = 0  # the window's first token: the first of the last emitted piece
        self.read = 0  # tokens whose text was emitted
        self.emitted = 0  # characters emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.start:self.read], skip_special_tokens=True)
        text = decode(self.ids[self.start:], skip_special_tokens=True)
        if "\ufffd" in text[:-1]:  # bytes that form no character inside the window: the whole decode decides
            before, text = self.emitted, decode(self.ids, skip_special_tokens=True)
        else:
            before = len(before)
        if text.endswith("\ufffd") or len(text) <= before:
            return ""  # an incomplete character, or nothing new yet: wait for the next token
        self.start, self.read = self.read, len(self.ids)
        self.emitted += len(text) - before
        return text[before:]
