"""Structured outputs with llguidance: a request's Structured constraint
compiled to a grammar, a matcher per request that follows its tokens, and
the bitmask of the tokens it allows next (one bit per vocabulary entry,
32 to an int32, as llguidance lays it out), computed on the host and
applied to the logits on the device (gdnx.serving.sampling.allow).

llguidance works on the tokenizer's own vocabulary (tokenizer.json), each
token as the tokenizer treats it (`llg_tokenizer`): the bitmask is as wide
as the model's vocabulary, whose entries past the tokenizer's are never
allowed.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from gdnx.errors import FieldError
from gdnx.serving import finite
from gdnx.serving.params import Structured


def words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


ALL = -1  # a bitmask word allowing all 32 of its tokens
# compiled grammars kept for reuse, the least recently used dropped past this many (clients choose the constraints)
CACHED_GRAMMARS = 256
# a constraint whose grammar takes longer to compile is refused (the grammar engine's own fuel limits bound it too)
COMPILE_S = 10.0
COMPILE_THREADS = 2
# Constraints past this many characters compile on a lane of their own (one thread): a client's huge schemas,
# whose compiles run on past their refusal, then hold up only each other, never the small ones beside them
LARGE_CONSTRAINT = 16_384
# A bounded repetition in a regex (a regex constraint, a Lark terminal, a
# JSON schema's pattern: {n}, {m,n}, Lark's ~ n) builds lexer expressions
# per count, a budget the grammar engine's copies of one grammar share: it
# failed only once a request's own copy computed its mask (b{300000}: the
# first copy's mask passed, the next ones failed), so longer ones are
# refused up front; a matcher that fails later fails its request.
MAX_REPEAT = 10_000
_REGEX_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_REPEAT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def repeat_limit_error(s: Structured) -> str | None:
    """Why `s` needs more repetitions than MAX_REPEAT, or None."""
    def counts(text: str, pattern: re.Pattern) -> list[int]:
        return [int(n) for m in pattern.finditer(text) for n in m.groups() if n]

    found: list[int] = []
    if not isinstance(s.value, str):  # a choice's strings repeat nothing
        return None
    if s.kind == "regex":
        found = counts(s.value, _REGEX_REPEAT)
    elif s.kind == "grammar":
        found = counts(s.value, _REGEX_REPEAT) + counts(s.value, _LARK_REPEAT)
    elif s.kind == "json":
        def walk(node: Any) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "pattern" and isinstance(value, str):
                        found.extend(counts(value, _REGEX_REPEAT))
                    walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)
        try:
            walk(json.loads(s.value))
        except ValueError:
            return None  # not JSON: the grammar engine's own message names that
    worst = max(found, default=0)
    if worst > MAX_REPEAT:
        return f"a repetition of {worst} passes the grammar engine's limit of {MAX_REPEAT:,}"
    return None


def infinite_error(s: Structured) -> str | None:
    """Why every output of `s` would be infinite (gdnx.serving.finite), or
    None: the grammar engine would accept it and run each request to its
    token limit."""
    if not isinstance(s.value, str):
        return None
    if s.kind == "grammar":
        return finite.lark_error(s.value)
    if s.kind == "json":
        try:
            return finite.json_schema_error(json.loads(s.value))
        except ValueError:
            return None  # not JSON: the grammar engine's own message names that
    return None


class Grammars:
    """Compiles constraints for one tokenizer. tokenizer_json: the
    tokenizer.json text; vocab_size: the model's vocabulary (the bitmask's
    width); eos_id: the token that ends a complete output. The last
    CACHED_GRAMMARS constraints used stay compiled, each with a matcher at
    its start that a request's matcher is copied from. Any thread may call
    it: a compile runs on a thread of its own and is refused past
    `compile_s` seconds (the caller, a server's request thread, is free
    again; the compile runs out in the background). Large constraints
    (past LARGE_CONSTRAINT characters) compile on a lane of their own, so
    those running out never hold up a small one's compile."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int, compile_s: float = COMPILE_S):
        self._json, self.vocab_size, self.eos_id, self.compile_s = tokenizer_json, vocab_size, eos_id, compile_s
        self._tokenizer: Any = None
        self._unsupported: str | None = None  # why this tokenizer cannot take constraints, once known
        self._cache: dict[Structured, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="gdnx-grammar")
        self._large = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gdnx-grammar-large")

    def _llg(self) -> Any:
        import llguidance

        return llguidance

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None and self._unsupported is None:  # about a second for a large vocabulary
                try:
                    self._tokenizer = llg_tokenizer(self._json, self.vocab_size, self.eos_id)
                except (ValueError, TypeError, RuntimeError) as e:  # a tokenizer.json llguidance cannot read
                    self._unsupported = _first(e)
            if self._unsupported is not None:
                raise ValueError(self._unsupported)
            return self._tokenizer

    def grammar(self, s: Structured) -> str:
        """The constraint's grammar, checked (FieldError naming s.field)."""
        return self._compiled(s)[0]

    def matcher(self, s: Structured) -> Matcher:
        return Matcher(self._compiled(s)[1].deep_copy())

    def _compiled(self, s: Structured) -> tuple[str, Any]:
        if (why := repeat_limit_error(s) or infinite_error(s)) is not None:
            raise FieldError(s.field, f"not a valid {s.kind} constraint: {why}")
        with self._lock:
            if s in self._cache:
                self._cache[s] = self._cache.pop(s)  # the most recently used last
                return self._cache[s]
        try:
            tokenizer = self.tokenizer
        except ValueError as e:
            raise FieldError(s.field, f"structured outputs are not available for this checkpoint's tokenizer "
                             f"(the grammar engine cannot read it: {e})") from None
        large = len(s.value if isinstance(s.value, str) else "".join(s.value)) > LARGE_CONSTRAINT
        job = (self._large if large else self._pool).submit(self._compile, s, tokenizer)
        try:
            compiled = job.result(timeout=self.compile_s)
        except concurrent.futures.TimeoutError:
            raise FieldError(s.field, f"not a valid {s.kind} constraint: it took longer than {self.compile_s:g} s to "
                             "compile; simplify it") from None
        with self._lock:
            self._cache[s] = compiled
            if len(self._cache) > CACHED_GRAMMARS:
                del self._cache[next(iter(self._cache))]
        return compiled

    def _compile(self, s: Structured, tokenizer: Any) -> tuple[str, Any]:
        m = self._llg().LLMatcher
        try:
            if s.kind == "json":
                grammar = m.grammar_from_json_schema(s.value)
            elif s.kind == "regex":
                grammar = m.grammar_from_regex(s.value)
            elif s.kind == "choice":  # Lark string literals: JSON's quoting
                grammar = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in s.value))
            else:
                grammar = m.grammar_from_lark(s.value)
        except (ValueError, TypeError) as e:
            raise FieldError(s.field, f"not a valid {s.kind} constraint: {_first(e)}") from None
        error = m.validate_grammar(grammar, tokenizer)
        if error:
            raise FieldError(s.field, f"not a valid {s.kind} constraint: {_first(error)}")
        start = m(tokenizer, grammar, log_level=0)
        probe = start.deep_copy()  # its first mask: a schema that only refers to itself allows nothing
        Matcher(probe).bitmask(np.zeros(words(self.vocab_size), np.int32))
        if probe.is_error():
            raise FieldError(s.field, f"not a valid {s.kind} constraint: no output satisfies it "
                             f"(the grammar engine: {_first(probe.get_error())})")
        return grammar, start


def llg_tokenizer(tokenizer_json: str, vocab_size: int, eos_id: int) -> Any:
    """llguidance's tokenizer for a tokenizer.json, each token of the kind the
    tokenizer gives it: a vocabulary entry its bytes (byte-level, byte
    fallback, metaspace: as llguidance reads them), an added token that is not
    special its text (Qwen's <tool_call>, one id, decoded as text), a special
    token a special token (text only where a grammar names it). llguidance,
    reading tokenizer.json itself, takes every added token for a special one,
    so a grammar's "<tool_call>" allowed that token and then refused it.
    Entries past the tokenizer's vocabulary (a model's padded rows) are
    special tokens no grammar names."""
    import llguidance
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tokenizer_json)
    n = min(hf.get_vocab_size(with_added_tokens=True), vocab_size)
    read = llguidance.LLTokenizer(tokenizer_json, n_vocab=n, eos_token=eos_id)
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special and i < n}
    tokens = [read.decode_bytes([i]) for i in range(n)]
    for i in range(n, vocab_size):
        tokens.append(f"<|gdnx:unused:{i}|>".encode())
    special.update(i for i, t in enumerate(tokens) if not t or i >= n)  # no text: never a grammar's bytes
    for i in special:
        tokens[i] = tokens[i] or f"<|gdnx:unused:{i}|>".encode()

    class Vocabulary:
        eos_token_id, bos_token_id = eos_id, None
        special_token_ids = sorted(special)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            return hf.encode(text, add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=vocab_size, eos_token=eos_id)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def error(self) -> str | None:
        """The grammar engine's error once it has failed (a limit of its
        lexer passed mid-output, say): its masks then allow only the end of
        the output, which must not pass for a finished one, so the request
        fails with this instead."""
        if not self._m.is_error():
            return None
        return _first(self._m.get_error() or "the grammar engine failed")

    def bitmask(self, into: np.ndarray) -> None:
        """The tokens allowed next, written into `into` (int32 [words(vocab)])."""
        self._m.unsafe_compute_mask_ptr(into.ctypes.data, into.size * into.itemsize)

    def consume(self, token: int) -> str | None:
        """Take a drawn token; the matcher's error if it was not allowed or
        the engine has failed (`error`)."""
        if (failed := self.error()) is not None:
            return failed
        if self._m.consume_token(int(token)) and not self._m.is_error():
            return None
        return self._m.get_error() or f"token {token} is not allowed by the constraint"


def _first(e: object) -> str:
    """The grammar engine's error in one line: its first, and where that
    only opens a listing (a regex's "regex parse error:" over the pattern
    and a caret), the listing's "error: ..." reason after it."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0]
    if head.endswith(":"):
        reason = next((line for line in lines[1:] if line.lower().startswith("error:")), None)
        if reason is not None:
            head = f"{head} {reason[len('error:'):].strip()}"
    return head[:300]


def only_ends(mask: np.ndarray, ends: Sequence[int]) -> bool:
    """Whether a row's bitmask allows nothing but the end tokens `ends`
    (its constraint's output is complete)."""
    rest = mask.view(np.uint32).copy()
    for e in ends:
        rest[e // 32] &= ~np.uint32(1 << (e % 32))
    return not rest.any()


def masks(matchers: list[Matcher | None], vocab_size: int) -> np.ndarray:
    """Bitmasks for rows of requests: a constrained row's allowed tokens,
    every token for the others."""
    out = np.full((len(matchers), words(vocab_size)), ALL, np.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.bitmask(out[i])
    return out
