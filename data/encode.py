"""Text to token ids, shared by SFT's examples, GRPO's prompts and the tool messages: the chat template's rendering,
batched encoding through a fast tokenizer's backend, and the cache of tokenized data keyed by everything tokenizing
reads (`cache_key`), so a restarted or repeated run skips the work.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import platform
import time
import zipfile

from config import console
from config.errors import UserError
from config.hf import TEMPLATE_VARIABLES

log = logging.getLogger(__name__)


def encode_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text, no special tokens added. A fast tokenizer's Rust backend is called directly: the
    same ids as `tokenizer(texts)`, without building a Python encoding object per text."""
    if not texts:
        return []
    if getattr(tokenizer, "is_fast", False):
        return [encoding.ids for encoding in encode_batch(texts, tokenizer)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_batch(texts: list[str], tokenizer) -> list:
    """A fast tokenizer's backend encodings of `texts` (ids and character offsets), no special tokens added, neither
    padded nor cut (`unpadded_backend`)."""
    with unpadded_backend(tokenizer) as backend:
        return backend.encode_batch(texts, add_special_tokens=False)


@contextlib.contextmanager
def unpadded_backend(tokenizer):
    """A fast tokenizer's backend with its padding and truncation off while in use: a tokenizer.json may carry them,
    which would pad a shorter text with ids that a loss mask learns or a policy reads, or cut a long one without a
    word. The settings belong to the shared backend: restored for every other caller."""
    backend = tokenizer.backend_tokenizer
    padding, truncation = backend.padding, backend.truncation
    if padding is None and truncation is None:
        yield backend
        return
    backend.no_padding()
    backend.no_truncation()
    try:
        yield backend
    finally:
        if padding is not None:
            backend.enable_padding(**padding)
        if truncation is not None:
            backend.enable_truncation(**truncation)


def require_chat_template(tokenizer) -> None:
    """A UserError for a tokenizer without a chat template (a base model's), before any conversation is rendered."""
    if tokenizer.chat_template is None:
        raise UserError(f"The tokenizer of {tokenizer.name_or_path!r} has no chat template, and every prompt and "
                        "conversation is rendered by one. Start from a checkpoint whose tokenizer has one (an "
                        "instruct model, or this trainer's SFT output), or set `chat_template` in its "
                        "tokenizer_config.json.")


def chat_text(messages: list[dict], tokenizer, tools: list | None, *, add_generation_prompt: bool = False) -> str:
    """Return the chat template's text of `messages`, offering `tools` (schemas or functions; None: no tools)."""
    require_chat_template(tokenizer)
    with template_errors_named(tokenizer, messages):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)


@contextlib.contextmanager
def template_errors_named(tokenizer, messages: list[dict]):
    """A chat template that raises on a conversation (`raise_exception` in Mistral's and Llama 2's: roles that do not
    alternate, a system turn it does not take) becomes a UserError naming the conversation's roles."""
    import jinja2

    try:
        yield
    except jinja2.TemplateError as error:
        roles = " -> ".join(str(message.get("role")) for message in messages if isinstance(message, dict))
        raise UserError(f"The chat template of {tokenizer.name_or_path!r} refused a conversation ({roles}): {error}. "
                        "Give the rows in the form this template takes (many require user and assistant turns to "
                        "alternate, some take no system turn), or train from a model whose template takes them.") from None


def template_error(tokenizer, problem: str) -> UserError:
    """Return the error for a chat template the loss mask cannot be derived from."""
    return UserError(f"The chat template of tokenizer {tokenizer.name_or_path!r} cannot be split into turns for "
                     f"the SFT loss mask: {problem}. Use a model whose template renders each turn as a plain suffix "
                     "of the previous turns, with assistant turns closed by a special token (the end token, or the "
                     "template's own such as <|im_end|>).")


def tokenizer_digest_parts(tokenizer, rendered_sample: str) -> list[str] | None:
    """What a cache key must cover of a fast tokenizer (None for a slow one, which has no one text of its state): its
    chat template, its variables (`data.chat_template_kwargs`) and special tokens, a sample as that template renders
    it now (a template that prints today's date renders differently tomorrow), the whole backend (vocabulary, merges,
    normalisation, added tokens), the versions of the libraries that render and encode (transformers' template
    functions such as `tojson`, jinja2, tokenizers:
    an upgrade may change the rendering of rows unlike the one sample, such as a row's own tools) and the source of
    this module and of `data.batches` (a change to the tokenization code is a new key; callers add their own)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    import jinja2
    import tokenizers
    import transformers

    versions = {module.__name__: module.__version__ for module in (transformers, tokenizers, jinja2)}
    return [json.dumps({"chat_template": tokenizer.chat_template, "special_tokens": tokenizer.special_tokens_map,
                        "variables": getattr(tokenizer, TEMPLATE_VARIABLES, {}), "rendering": rendered_sample,
                        "versions": versions}, sort_keys=True, default=str),
            tokenizer.backend_tokenizer.to_str(), pathlib.Path(__file__).read_text(),
            pathlib.Path(__file__).with_name("batches.py").read_text()]


def cache_key(state: dict, tokenizer, rendered_sample: str, *sources: str) -> str | None:
    """A digest of `state` (JSON), the tokenizer (`tokenizer_digest_parts`) and `sources`; None for a slow tokenizer.

    The state's keys keep their order: a chat template prints a mapping in its order (`tojson` of a tool or a call's
    arguments, `parameters.properties.keys()`), so a schema whose parameters were reordered renders other ids, and a
    key that sorted them read the old ids from the cache."""
    parts = tokenizer_digest_parts(tokenizer, rendered_sample)
    if parts is None:
        return None
    digest = hashlib.sha256()
    for part in (json.dumps(state, default=str), *parts, *sources):
        digest.update(hashlib.sha256(part.encode()).digest())
    return digest.hexdigest()[:32]


def read_cached_arrays(cache_dir: pathlib.Path, folder: str, key: str) -> dict | None:
    """The arrays stored under `key` by `write_cached_arrays`, or None when they are missing or damaged."""
    import numpy

    try:
        with numpy.load(cache_dir / folder / f"{key}.npz", allow_pickle=False) as stored:
            return {name: stored[name] for name in stored.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None


def write_cached_arrays(cache_dir: pathlib.Path, folder: str, key: str, arrays: dict) -> None:
    """Store numpy `arrays` under `key` as one uncompressed .npz (`write_atomically`): token ids read back as arrays
    in one piece, where JSON parses a Python object per token."""
    import numpy

    write_atomically(cache_dir / folder / f"{key}.npz", lambda file: numpy.savez(file, **arrays))


def write_atomically(path: pathlib.Path, write) -> None:
    """`write(binary file)` into a staging file renamed to `path`: every process may write the same entry, and nodes
    may share the cache. A cache that cannot be written is left out with a warning from the rank that could not write
    it (a node's own disk may be the full or read-only one: `config.console.ABOUT_THIS_RANK`)."""
    staging = path.with_name(f".{path.name}.{platform.node()}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(staging, "wb") as file:
            write(file)
        os.replace(staging, path)
    except OSError as error:
        log.warning("tokenized data not cached (%s); set data.cache=false or $TRAINER_CACHE_DIR to a writable "
                    "directory to silence this", error, extra=console.ABOUT_THIS_RANK)
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)


@contextlib.contextmanager
def building(cache_dir: pathlib.Path, folder: str, key: str):
    """Held while this process builds the entry `key`: another one building the same entry (a rank of this run, or a
    run beside it) waits here, then reads what this one wrote instead of tokenizing it all again. The lock is the
    kernel's (`flock`), so it goes with a process that dies; a cache where none can be taken is built without one."""
    path = cache_dir / ".locks" / f"{folder}-{key}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process that is building the cache entry %s", cache_dir / folder / key)
                wait_for_lock(handle, cache_dir / folder / key)
        except OSError:
            pass  # a file system without locks: each process builds, and the atomic write keeps the entry whole
        yield


def wait_for_lock(handle, entry: pathlib.Path) -> None:
    """Take `handle`'s lock once the process building `entry` lets it go, saying every `PROGRESS_INTERVAL_S` how long
    this one has waited: the builder may be a rank other than 0, whose progress lines (`with_progress`) the console
    drops, and rank 0, waiting, printed one line and then nothing for the minutes a cold build of a large set takes."""
    start = last = time.monotonic()
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(LOCK_POLL_S)
        now = time.monotonic()
        if now - last >= PROGRESS_INTERVAL_S:
            last = now
            log.info("still waiting for another process that is building the cache entry %s: %.0f s so far", entry,
                     now - start)


# How often a process waiting for a cache entry tries its lock: reading the entry starts at most this late.
LOCK_POLL_S = 0.2

# Texts per batched tokenizer call: fast, without holding every rendering at once.
TOKENIZE_CHUNK = 1024

# A line at least this often while tokenizing: a large data set takes minutes, which were silent.
PROGRESS_INTERVAL_S = 10.0


def with_progress(items, total: int, what: str):
    """`items`, with a log line every `PROGRESS_INTERVAL_S` seconds saying how many of `total` `what` are done and
    about how long the rest takes (rank 0 prints it: `config.console`)."""
    start = last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= PROGRESS_INTERVAL_S and done < total:
            last = now
            log.info("%s: %d of %d (%.0f%%), %.0f s so far, about %.0f s left", what, done, total, 100 * done / total,
                     now - start, (now - start) * (total - done) / done)
