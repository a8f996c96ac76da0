"""The mixed workload of bench_serving.py: request lengths, arrival times and prompts, all from a seed.

- Lengths: prompt and output token counts are log-uniform integers on their ranges (16 to 2,000 prompt
  tokens by default): every doubling of the length is equally likely, so short chat turns and long
  documents both come up often. Real prompt lengths spread over orders of magnitude (roughly
  log-normal in public traces); a uniform draw on 16..2,000 would make 99 % of the prompts longer than
  36 tokens and half of them longer than 1,000. The ranges are trimmed first so that every prompt plus
  its output fits max_model_len.
- Arrivals: a Poisson process at `rate` requests/s (exponential gaps of mean 1 / rate, the first at 0),
  as vLLM's benchmark_serving.py --request-rate; rate inf sends them all at once. The gaps are unit
  exponentials divided by the rate, so every rate of a run has the same pattern, scaled.
- Prompts: real text, the words of WORDS, drawn per request; the first word is a hash of the run's salt
  and the request's index, so no prompt shares a first KV block with another (this run's or an earlier
  one's) and a prefix cache serves none of them. `token_prompt` cuts the text's tokens (from the
  server's /tokenize) to exactly the drawn length; `words_prompt` is the text alone, for a server
  without /tokenize.

Each quantity has its own random stream (seeded with the seed and its name, and the request's index for
the words), so that a request's lengths do not depend on how many requests a level sends, nor on the
rate, and its words do not depend on its length.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

WORDS = ("the", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "was", "at", "by", "be",
         "this", "from", "or", "have", "an", "they", "which", "one", "you", "had", "not", "but", "what", "all",
         "were", "when", "we", "there", "can", "more", "if", "no", "out", "so", "said", "use", "each", "she", "do",
         "how", "their", "will", "up", "about", "many", "then", "them", "these", "some", "her", "would", "make",
         "like", "him", "into", "time", "has", "look", "two", "go", "see", "way", "could", "people", "than", "first",
         "water", "been", "call", "who", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may",
         "part", "over", "new", "sound", "take", "only", "little", "work", "know", "place", "year", "live", "back",
         "give", "most", "very", "after", "thing", "our", "just", "name", "good", "man", "think", "say", "great",
         "where", "help", "through", "much", "before", "line", "right", "too", "mean", "old", "any", "same", "tell",
         "house", "point", "page", "letter", "mother", "answer", "found", "study", "still", "learn", "should",
         "world", "high", "every", "near", "add", "food", "between", "own", "below", "country", "plant", "last",
         "school", "father", "keep", "tree", "never", "start", "city", "earth", "eye", "light", "thought", "head")
PROMPT_LEN = (16, 2000)  # tokens, the default range
OUTPUT_LEN = (16, 512)

Tokenize = Callable[[str], Awaitable[list[int]]]


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt_len: int  # tokens (with --api chat, the user message's: the chat template adds its own)
    output_len: int  # max_tokens
    arrival_s: float  # when it is sent, in seconds from the level's start (0 at a fixed concurrency)


def fit_ranges(prompt_len: tuple[int, int], output_len: tuple[int, int], max_model_len: int,
               reserve: int = 0) -> tuple[tuple[int, int], tuple[int, int]]:
    """The ranges trimmed so that any prompt plus any output fits max_model_len less `reserve` tokens
    (what the server adds to a prompt: a BOS token, a chat template). The output range is trimmed first
    to leave room for the shortest prompt, then the prompt range to the room the longest output leaves."""
    (p_lo, p_hi), (o_lo, o_hi) = prompt_len, output_len
    if not 1 <= p_lo <= p_hi or not 1 <= o_lo <= o_hi:
        raise ValueError(f"expected 1 <= min <= max, got prompt {prompt_len}, output {output_len}")
    room = max_model_len - reserve
    o_hi = min(o_hi, room - p_lo)
    if o_hi < 1:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a {p_lo}-token prompt "
                         f"(+{reserve} reserved) and one output token")
    o_lo = min(o_lo, o_hi)
    return (p_lo, min(p_hi, room - o_hi)), (o_lo, o_hi)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose logarithm is uniform: floor(exp(u)), u uniform on [ln lo, ln(hi + 1))."""
    return min(hi, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def draw_lengths(seed: int, name: str, n: int, lo: int, hi: int) -> list[int]:
    """The first n log-uniform lengths of the stream `name` of `seed`."""
    rng = random.Random(f"{seed}-{name}")
    return [log_uniform(rng, lo, hi) for _ in range(n)]


def arrival_times(seed: int, n: int, rate: float) -> list[float]:
    """Send times (s) of a Poisson process at `rate` requests/s: the first at 0, then exponential gaps of
    mean 1 / rate; all 0 for rate inf."""
    if not rate > 0:
        raise ValueError(f"request rate: expected > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}-arrivals")
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


def mixed_workload(n: int, seed: int, prompt_len: tuple[int, int] = PROMPT_LEN,
                   output_len: tuple[int, int] = OUTPUT_LEN, max_model_len: int | None = None,
                   reserve: int = 0, rate: float = math.inf) -> list[WorkloadRequest]:
    """n requests: log-uniform prompt and output lengths in their ranges (trimmed by fit_ranges to
    max_model_len when given), sent at the arrival times of `rate` (inf: at once)."""
    if max_model_len is not None:
        prompt_len, output_len = fit_ranges(prompt_len, output_len, max_model_len, reserve)
    prompts = draw_lengths(seed, "prompt", n, *prompt_len)
    outputs = draw_lengths(seed, "output", n, *output_len)
    arrivals = arrival_times(seed, n, rate)
    return [WorkloadRequest(i, p, o, t) for i, (p, o, t) in enumerate(zip(prompts, outputs, arrivals))]


def unique_word(salt: str, index: int) -> str:
    """The first word of a prompt: a hash of the run's salt and the request's index (it differs from
    every other prompt's within its first few tokens)."""
    return "q" + hashlib.sha256(f"{salt}-{index}".encode()).hexdigest()[:8]


def words(seed: int, index: int) -> random.Random:
    """The random stream of request `index`'s words."""
    return random.Random(f"{seed}-words-{index}")


def prompt_text(seed: int, salt: str, index: int, count: int) -> str:
    """The unique word, then `count` words of request `index`'s stream."""
    rng = words(seed, index)
    return " ".join([unique_word(salt, index), *(rng.choice(WORDS) for _ in range(count))])


async def token_prompt(tokenize: Tokenize, seed: int, salt: str, index: int, length: int,
                       chunk_words: int = 256) -> list[int]:
    """Exactly `length` token ids of prompt_text(seed, salt, index, ...): the text is tokenized a chunk
    of words at a time (a server's /tokenize takes at most max_model_len tokens at once), each chunk
    after the first starting with its space, until there are enough tokens; every word makes at least
    one token, so a chunk asks for no more words than tokens are missing."""
    rng = words(seed, index)
    ids: list[int] = []
    head = unique_word(salt, index)
    while len(ids) < length:
        chunk = [rng.choice(WORDS) for _ in range(max(1, min(chunk_words, length - len(ids))))]
        ids += await tokenize(" ".join([head, *chunk]) if not ids else " " + " ".join(chunk))
    return ids[:length]


def words_prompt(seed: int, salt: str, index: int, length: int, tokens_per_word: float) -> str:
    """A text of about `length` tokens at `tokens_per_word`, for a server without /tokenize."""
    return prompt_text(seed, salt, index, max(1, round(length / tokens_per_word) - 1))


async def gather_limited(coros: list[Awaitable], limit: int = 8) -> list:
    """The results of `coros`, at most `limit` running at once."""
    gate = asyncio.Semaphore(limit)

    async def one(coro: Awaitable) -> object:
        async with gate:
            return await coro

    return list(await asyncio.gather(*(one(c) for c in coros)))


# ---------------------------------------------------------------------------- prompts on a server's tokenizer
async def server_tokenize(client: httpx.AsyncClient, model: str, text: str) -> list[int]:
    """A text's token ids, without special tokens, from the server's /tokenize (ep-serve's, vLLM's, SGLang's)."""
    resp = await client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    if resp.status_code != 200:
        raise RuntimeError(f"/tokenize: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()["tokens"]


async def server_detokenize(client: httpx.AsyncClient, model: str, ids: list[int]) -> str:
    """The text of token ids, from the server's /detokenize (vLLM's answer says "prompt", SGLang's "text")."""
    resp = await client.post("/detokenize", json={"model": model, "tokens": ids})
    if resp.status_code != 200:
        raise RuntimeError(f"/detokenize: HTTP {resp.status_code}: {resp.text[:300]}")
    body = resp.json()
    return body["prompt"] if "prompt" in body else body["text"]


@dataclass
class PromptMaker:
    """Makes the workload's prompts on the server's own tokenizer: mode "ids", token ids of exactly the
    drawn length (/v1/completions); "text", their text (/detokenize: chat); "words", text of words at
    `tokens_per_word` (a server without /tokenize: lengths approximate)."""

    client: httpx.AsyncClient
    model: str
    seed: int
    mode: str
    tokens_per_word: float
    chunk_words: int = 256

    async def make(self, request: WorkloadRequest, salt: str) -> str | list[int]:
        if self.mode == "words":
            return words_prompt(self.seed, salt, request.index, request.prompt_len, self.tokens_per_word)
        ids = await token_prompt(lambda text: server_tokenize(self.client, self.model, text), self.seed, salt,
                                 request.index, request.prompt_len, self.chunk_words)
        return ids if self.mode == "ids" else await server_detokenize(self.client, self.model, ids)


async def prompt_maker(client: httpx.AsyncClient, model: str, chat: bool, seed: int, first_text: str,
                       first_prompt_tokens: int | None, max_model_len: int) -> tuple[PromptMaker, int, str]:
    """The prompt maker the server allows; the tokens to reserve in max_model_len for what the server adds
    to a prompt; and a line that says so. The reserve is what the usage of the first request (whose
    prompt was `first_text`) counted beyond the text's own tokens (a BOS, the chat template), plus 8 for
    chat (its text is tokenized again), at least 1; without that usage 1, and 64 for chat."""
    first_words = len(first_text.split())
    try:
        first_ids = await server_tokenize(client, model, first_text)
        if chat:
            await server_detokenize(client, model, first_ids[:4])
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as e:
        per_word = first_prompt_tokens / first_words if first_prompt_tokens else 1.5
        how = (f"text of words at {per_word:.2f} tokens a word ({'measured' if first_prompt_tokens else 'guessed'}: "
               f"the server's /tokenize or /detokenize failed: {e}), lengths approximate")
        return PromptMaker(client, model, seed, "words", per_word), 64 if chat else 16, how
    per_word = len(first_ids) / first_words
    chunk_words = max(1, int(max_model_len / (3 * per_word)))  # what /tokenize takes at once, with room
    if first_prompt_tokens:
        reserve = max(1, first_prompt_tokens - len(first_ids)) + (8 if chat else 0)
    else:
        reserve = 64 if chat else 1
    how = (f"{'the text of token ids' if chat else 'token ids'} from the server's /tokenize, exactly the drawn "
           f"length{' (the chat template adds its own)' if chat else ''}; {reserve} tokens of max_model_len reserved")
    return PromptMaker(client, model, seed, "text" if chat else "ids", per_word, chunk_words), reserve, how
