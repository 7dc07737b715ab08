"""What vLLM supports on XLA through torch_xla_ext.vllm_platform, row by row, as found on XLA's
CPU, and docs/vllm_support.md, which the last test renders from the rows' outcomes.

vLLM runs as vllm_platform_test runs it (the built wheel in a fresh venv, tiny random
checkpoints, VLLM_XLA_CHECK_RECOMPILATION=1), one `LLM` per engine configuration in a process
of its own that takes requests one at a time. A row is

- supported: its test checked values: greedy tokens equal to transformers' (for a float8 KV
  cache, each token within a small logit margin of transformers' best); sampled tokens within
  the set the sampling fields allow under transformers' logits; logprobs equal to transformers';
- refused: vLLM raised a ValueError naming the feature, when the engine was configured or at
  the request;
- untested: no test here runs it (ROWS says why).

The last test fails where docs/vllm_support.md differs from this run's matrix;
`UPDATE_VLLM_SUPPORT=1 bazel run //tests/vllm_platform:support_matrix_test` writes it.
"""

import copy
import difflib
import itertools
import json
import os
import queue
import re
import string
import subprocess
import textwrap
import threading

import pytest
import torch

from tests.vllm_platform.common import installed, vllm_env  # noqa: F401  (installed: a fixture)
from torch_xla_ext.serving import hf

DOC = "docs/vllm_support.md"
MAX_TOKENS = 8
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=64)
SUPPORTED, REFUSED, UNTESTED = "supported", "refused", "untested"
CONTEXT = "max_model_len (KV page size)"

# The matrix in its order: (feature, value) -> None for a row a test here runs, else why no
# test does.
ROWS = {
    ("Model", "Llama (LlamaForCausalLM)"): None,
    ("Model", "other architectures"): "not run here: the tests' checkpoints are tiny Llamas",
    ("dtype", "float32"): None,
    ("dtype", "bfloat16"): None,
    ("dtype", "float16"): None,
    ("kv_cache_dtype", "auto (the model's dtype)"): None,
    ("kv_cache_dtype", "fp8_e4m3, bfloat16 model"): None,
    ("kv_cache_dtype", "fp8_e4m3, float16 model"): "not run here; the kernels' contract takes it",
    ("kv_cache_dtype", "fp8"): "not run here; vLLM's Pallas backend takes it as fp8_e4m3",
    ("kv_cache_dtype", "fp8_e4m3, float32 model"): None,
    ("kv_cache_dtype", "fp8_e5m2"): None,
    ("head size", "64"): None,
    ("head size", "128"): None,
    ("head size", "32 (vLLM's Pallas backend pads it to 128)"): None,
    ("head size", "80, 96, 112, 192, 256"): "not run here; in the kernels' contract",
    ("head size", "320"): None,
    (CONTEXT, "up to 256 (16)"): None,
    (CONTEXT, "257-512 (32)"): None,
    (CONTEXT, "513-1024 (64)"): None,
    (CONTEXT, "1025-2048 (128)"): "not run here",
    (CONTEXT, "2049-8192 (128: the Pallas backend's 256, which our kernels do not take)"): None,
    (CONTEXT, "above 8192 (16)"): "not run here",
    ("KV page size", "8"): "not run here: in the kernels' contract, but the Pallas backend "
                           "never picks it",
    ("Sampling", "greedy (temperature 0)"): None,
    ("Sampling", "temperature, top_k"): None,
    ("Sampling", "top_p"): None,
    ("Sampling", "min_p"): None,
    ("Sampling", "logprobs"): None,
    ("Sampling", "prompt_logprobs"): None,
    ("Sampling", "presence_penalty"): None,
    ("Sampling", "frequency_penalty"): None,
    ("Sampling", "repetition_penalty"): None,
    ("Sampling", "logit_bias"): None,
    ("Sampling", "allowed_token_ids"): None,
    ("Sampling", "bad_words"): None,
    ("Sampling", "seed"): None,
    ("Sampling", "stop (strings)"): None,
    ("Sampling", "stop_token_ids"): None,
    ("Prefix caching", "enable_prefix_caching"): None,
    ("Chunked prefill", "a prompt longer than max_num_batched_tokens"): None,
    ("Structured output", "choice"): None,
    ("Structured output", "json, regex, grammar"): "not run here; vLLM applies every kind "
                                                   "through the same token bitmask as choice",
    ("Tensor parallel", "tensor_parallel_size > 1"): "not run here: it needs several XLA "
                                                     "devices (GPUs)",
    ("Pooling models", "runner pooling"): None,
    ("Speculative decoding", "speculative_config"): None,
    ("M-RoPE models", "Qwen2-VL"): None,
    ("LoRA", "enable_lora"): None,
}
_outcomes = {}  # (feature, value) -> (status, notes), as this run's tests found them


def record(feature, value, status, notes):
    assert ROWS[feature, value] is None, f"({feature}, {value}) is not a row a test runs"
    _outcomes[feature, value] = (status, notes)


def _prompts(lengths, seed):
    """Random prompts' token ids, none a special token (0-2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, hf.TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


# Lengths crossing pages of 16; 4 of them at once fill max_num_seqs.
PROMPTS = _prompts([5, 17, 40, 9, 23, 3], seed=7)


def _save_tokenizer(directory):
    """A tokenizer for the tiny vocabulary, each token one piece of text (the printable ASCII
    characters, then pairs of lowercase letters), so that vLLM detokenizes (stop strings) and
    builds grammars (structured output) as for a real model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the Llama config's bos and eos
    pairs = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    pieces = (specials + [chr(c) for c in range(0x20, 0x7f)] + pairs)[:hf.TINY["vocab_size"]]
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def _checkpoint(directory, dtype, seed, **config):
    """A tiny random Llama of `dtype` saved in `directory`; the model."""
    model = hf.random_model(dict(hf.TINY, **config), seed=seed, dtype=dtype)
    model.config.torch_dtype = dtype
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def float32_checkpoint(tmp_path_factory):
    """(directory, model): head size 64, with a tokenizer."""
    directory = tmp_path_factory.mktemp("float32")
    model = _checkpoint(directory, torch.float32, seed=0)
    _save_tokenizer(directory)
    return str(directory), model


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tmp_path_factory):
    """(directory, model): head size 128, up to 4096 positions."""
    directory = tmp_path_factory.mktemp("bfloat16")
    return str(directory), _checkpoint(directory, torch.bfloat16, seed=1, head_dim=128,
                                       max_position_embeddings=4096)


@pytest.fixture(scope="module")
def float16_checkpoint(tmp_path_factory):
    """(directory, model): head size 32, up to 1024 positions."""
    directory = tmp_path_factory.mktemp("float16")
    return str(directory), _checkpoint(directory, torch.float16, seed=2, head_dim=32,
                                       max_position_embeddings=1024)


_LLM_LOOP = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def reply(**fields):
        print("REPLY", json.dumps(fields), flush=True)

    def described(output):
        completion = output.outputs[0]
        return {"tokens": list(completion.token_ids), "text": completion.text,
                "finish_reason": completion.finish_reason,
                "num_cached_tokens": output.num_cached_tokens,
                "logprobs": [{token: logprob.logprob for token, logprob in position.items()}
                             for position in completion.logprobs or []]}

    llm = LLM(**json.loads(sys.argv[1]))
    reply(page_size=llm.llm_engine.vllm_config.cache_config.block_size)
    for line in sys.stdin:  # a request: [prompts' token ids, SamplingParams' fields]
        prompts, fields = json.loads(line)
        if "logit_bias" in fields:  # JSON's keys are strings
            fields["logit_bias"] = {int(t): bias for t, bias in fields["logit_bias"].items()}
        if "structured_outputs" in fields:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(**fields), use_tqdm=False)
        except ValueError as error:
            reply(error=str(error))
        else:
            reply(outputs=[described(o) for o in outputs])
""")


class LLMProcess:
    """vLLM's `LLM(**engine_args)` in a process of the fresh venv, generating the requests it
    is sent one at a time; `page_size`: the KV page size its engine took."""

    def __init__(self, python, engine_args, directory):
        self.log_path = directory / "llm.log"
        self._log = open(self.log_path, "a")
        self._process = subprocess.Popen(
            [python, "-c", _LLM_LOOP, json.dumps(engine_args)], cwd=directory, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=vllm_env(directory))
        self._replies = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.page_size = self._reply()["page_size"]

    def _read(self):
        for line in self._process.stdout:
            if line.startswith("REPLY "):
                self._replies.put(json.loads(line[len("REPLY "):]))
            else:  # vLLM's log, which it prints to stdout
                self._log.write(line)
                self._log.flush()
        self._replies.put(None)

    def _reply(self):
        try:
            reply = self._replies.get(timeout=600)
        except queue.Empty:
            reply = None
        if reply is None:
            raise AssertionError("the LLM process exited or hung:\n"
                                 + open(self.log_path).read()[-6000:])
        return reply

    def generate(self, prompts, **fields):
        """{"outputs": [per prompt: tokens, text, finish_reason, num_cached_tokens, logprobs]},
        or {"error": the ValueError's message} for a refused request."""
        self._process.stdin.write(json.dumps([prompts, fields]) + "\n")
        self._process.stdin.flush()
        return self._reply()

    def close(self):
        self._process.stdin.close()
        try:
            self._process.wait(timeout=120)
        finally:
            self._process.kill()
            self._log.close()


def _llm(installed, tmp_path_factory, name, **engine_args):
    return LLMProcess(installed[0], dict(LIMITS, **engine_args), tmp_path_factory.mktemp(name))


def _outputs(reply):
    assert "outputs" in reply, reply
    return reply["outputs"]


def _greedy(llm, prompts, **fields):
    return [o["tokens"] for o in _outputs(llm.generate(
        prompts, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields))]


def _assert_transformers_greedy(model, prompt, tokens):
    """`tokens` are transformers' greedy ones in the model's dtype; where not, the message
    names the first that differs and transformers' logit margin there."""
    expected, logits = hf.reference_generate(model, prompt, len(tokens))
    differ = [i for i, (e, t) in enumerate(zip(expected, tokens)) if e != t]
    if differ:
        i = differ[0]
        margin = float(logits[i][expected[i]] - logits[i][tokens[i]])
        raise AssertionError(f"vLLM's tokens {tokens} differ from transformers' {expected} "
                             f"from token {i}, where transformers' logit margin is {margin:.4f}")


def _logits_along(model, prompt, tokens):
    """transformers' float32 logits for each of `tokens`, given the prompt and those before."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1:-1]


def _assert_logprobs(logits, returned, tolerance):
    """The logprobs vLLM returned for each position are log_softmax of `logits` there."""
    for position, logprobs in zip(logits, returned):
        expected = torch.log_softmax(position, -1)
        for token, logprob in logprobs.items():
            assert abs(logprob - expected[int(token)]) < tolerance, (token, logprob,
                                                                     float(expected[int(token)]))


# ---------------------------------------------------------------------------------------------
# float32, head size 64, max_model_len 128: the sampling fields, prefix caching, chunked
# prefill, stop strings and structured output.

@pytest.fixture(scope="class")
def float32_llm(installed, float32_checkpoint, tmp_path_factory):
    llm = _llm(installed, tmp_path_factory, "float32_llm", model=float32_checkpoint[0],
               dtype="float32", max_model_len=128, enable_prefix_caching=True)
    yield llm
    llm.close()


class TestFloat32:

    def test_greedy_tokens_are_transformers(self, float32_llm, float32_checkpoint):
        _, model = float32_checkpoint
        assert float32_llm.page_size == 16
        for prompt, tokens in zip(PROMPTS, _greedy(float32_llm, PROMPTS)):
            _assert_transformers_greedy(model, prompt, tokens)
        checked = "greedy tokens equal transformers' (float32, 6 prompts of 3-40 tokens)"
        record("Model", "Llama (LlamaForCausalLM)", SUPPORTED, checked)
        record("dtype", "float32", SUPPORTED, checked)
        record("kv_cache_dtype", "auto (the model's dtype)", SUPPORTED, checked + "; and "
               "bfloat16, float16 below")
        record("head size", "64", SUPPORTED, checked + ", unpadded")
        record("Sampling", "greedy (temperature 0)", SUPPORTED, checked)

    def test_a_prompt_longer_than_the_step_budget(self, float32_llm, float32_checkpoint):
        _, model = float32_checkpoint
        prompt, = _prompts([100], seed=8)
        tokens, = _greedy(float32_llm, [prompt])
        _assert_transformers_greedy(model, prompt, tokens)
        record("Chunked prefill", "a prompt longer than max_num_batched_tokens", SUPPORTED,
               "a 100-token prompt over steps of 64 tokens: greedy tokens equal transformers'")
        record(CONTEXT, "up to 256 (16)", SUPPORTED, "max_model_len 128 (page size 16), a "
               "100-token prompt: greedy tokens equal transformers'")

    def test_prefix_caching_reuses_pages_and_keeps_the_tokens(self, float32_llm,
                                                              float32_checkpoint):
        _, model = float32_checkpoint
        prefix, first, second = _prompts([40, 5, 7], seed=9)
        prompts = [prefix + first, prefix + first, prefix + second]  # one at a time
        outputs = [_outputs(float32_llm.generate([p], temperature=0, max_tokens=MAX_TOKENS,
                                                 ignore_eos=True))[0] for p in prompts]
        # The second and third find the prefix's 2 full pages of 16 tokens cached.
        assert [o["num_cached_tokens"] for o in outputs] == [0, 32, 32]
        for prompt, output in zip(prompts, outputs):
            _assert_transformers_greedy(model, prompt, output["tokens"])
        record("Prefix caching", "enable_prefix_caching", SUPPORTED, "a prompt again, and "
               "another with its 40-token prefix: 32 tokens cached, greedy tokens equal "
               "transformers'")

    def _sample(self, llm, model, allowed, **fields):
        """Samples 8 tokens for 4 prompts with `fields` and logprobs=5; checks each token is
        in allowed(transformers' logits at its position), not all are the greedy ones, and
        the logprobs are transformers'."""
        outputs = _outputs(llm.generate(PROMPTS[:4], max_tokens=MAX_TOKENS, ignore_eos=True,
                                        logprobs=5, **fields))
        not_greedy = 0
        for prompt, output in zip(PROMPTS, outputs):
            logits = _logits_along(model, prompt, output["tokens"])
            for position, token in zip(logits, output["tokens"]):
                assert token in allowed(position), (token, fields)
                not_greedy += token != int(position.argmax())
            _assert_logprobs(logits, output["logprobs"], 1e-3)  # float32: they differ by ~1e-6
            assert all(len(logprobs) in (5, 6) for logprobs in output["logprobs"])
        assert not_greedy, f"{fields}: every sampled token was the greedy one"

    def test_sampled_tokens_are_in_transformers_top_k(self, float32_llm, float32_checkpoint):
        _, model = float32_checkpoint

        def top_5(logits):  # ties at the 5th within float32 noise are in
            return set(torch.nonzero(logits >= logits.topk(5).values[-1] - 1e-4).flatten()
                       .tolist())

        self._sample(float32_llm, model, top_5, temperature=0.8, top_k=5)
        record("Sampling", "temperature, top_k", SUPPORTED, "temperature 0.8, top_k 5: every "
               "sampled token in transformers' top 5, not all the greedy ones")
        record("Sampling", "logprobs", SUPPORTED, "logprobs 5: the model's own (before "
               "temperature and top_k), equal to log_softmax of transformers' logits to 1e-3")

    def test_sampled_tokens_are_in_transformers_top_p(self, float32_llm, float32_checkpoint):
        _, model = float32_checkpoint

        def nucleus(logits):  # the tokens whose more probable ones hold less than top_p
            probs, order = torch.softmax(logits / 0.8, -1).sort(descending=True)
            return set(order[probs.cumsum(0) - probs < 0.05 + 1e-4].tolist())

        self._sample(float32_llm, model, nucleus, temperature=0.8, top_p=0.05)
        record("Sampling", "top_p", SUPPORTED, "temperature 0.8, top_p 0.05: every sampled "
               "token in transformers' nucleus, not all the greedy ones")

    def test_sampled_tokens_pass_transformers_min_p(self, float32_llm, float32_checkpoint):
        _, model = float32_checkpoint

        def above_min_p(logits):
            probs = torch.softmax(logits / 0.8, -1)
            return set(torch.nonzero(probs >= (0.8 - 1e-4) * probs.max()).flatten().tolist())

        self._sample(float32_llm, model, above_min_p, temperature=0.8, min_p=0.8)
        record("Sampling", "min_p", SUPPORTED, "temperature 0.8, min_p 0.8: every sampled "
               "token at least 0.8 of transformers' most probable, not all the greedy ones")

    def test_a_stop_string_ends_the_output(self, float32_llm, float32_checkpoint):
        from transformers import AutoTokenizer

        directory, model = float32_checkpoint
        tokenizer = AutoTokenizer.from_pretrained(directory)
        greedy = hf.reference_generate(model, PROMPTS[1], MAX_TOKENS)[0]
        text, stop = tokenizer.decode(greedy), tokenizer.decode(greedy[3:5])
        end = next(n for n in range(len(greedy)) if stop in tokenizer.decode(greedy[:n]))
        output, = _outputs(float32_llm.generate([PROMPTS[1]], temperature=0, ignore_eos=True,
                                                max_tokens=MAX_TOKENS, stop=[stop]))
        assert output["finish_reason"] == "stop"
        assert output["text"] == text[:text.index(stop)]
        assert output["tokens"] == greedy[:end]
        record("Sampling", "stop (strings)", SUPPORTED, "the text of 2 greedy tokens: "
               "transformers' tokens up to it, text before it")

    def test_a_stop_token_id_ends_the_output(self, float32_llm, float32_checkpoint):
        _, model = float32_checkpoint
        greedy = hf.reference_generate(model, PROMPTS[2], MAX_TOKENS)[0]
        output, = _outputs(float32_llm.generate([PROMPTS[2]], temperature=0, ignore_eos=True,
                                                max_tokens=MAX_TOKENS, stop_token_ids=[greedy[3]]))
        assert output["finish_reason"] == "stop"
        assert output["tokens"] == greedy[:greedy.index(greedy[3]) + 1]
        record("Sampling", "stop_token_ids", SUPPORTED, "a greedy token: transformers' tokens "
               "up to it")

    def test_structured_output_choice(self, float32_llm, float32_checkpoint):
        from transformers import AutoTokenizer

        directory, model = float32_checkpoint
        tokenizer = AutoTokenizer.from_pretrained(directory)
        choices = ["yes", "no", "maybe so"]
        output, = _outputs(float32_llm.generate([PROMPTS[0]], temperature=0, max_tokens=16,
                                                structured_outputs={"choice": choices}))
        assert output["text"] in choices
        assert output["tokens"] == _greedy_choice(model, tokenizer, PROMPTS[0], choices)
        record("Structured output", "choice", SUPPORTED, "greedy tokens equal transformers' "
               "best among those that keep the text a prefix of a choice, then EOS")

    @pytest.mark.parametrize("fields, row, named", [
        ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs=1"),
        ({"presence_penalty": 2.0}, "presence_penalty", "presence_penalty=2.0"),
        ({"frequency_penalty": 1.0}, "frequency_penalty", "frequency_penalty=1.0"),
        ({"repetition_penalty": 10.0}, "repetition_penalty", "repetition_penalty=10.0"),
        ({"logit_bias": {"5": 100.0}}, "logit_bias", "logit_bias={5: 100.0}"),
        ({"allowed_token_ids": [7]}, "allowed_token_ids", "allowed_token_ids=[7]"),
        ({"bad_words": ["jj"]}, "bad_words", "bad_words=['jj']"),
        ({"seed": 1, "temperature": 0.8}, "seed", "per-request seed"),
    ])
    def test_a_request_with_a_field_the_platform_refuses(self, float32_llm, fields, row, named):
        reply = float32_llm.generate([PROMPTS[0]], max_tokens=MAX_TOKENS, **fields)
        assert named in reply.get("error", ""), reply
        record("Sampling", row, REFUSED, f"at the request: {reply['error']}")


def _greedy_choice(model, tokenizer, prompt, choices):
    """transformers' greedy tokens under vLLM's `choice` structured output: the best token
    whose text keeps the output a prefix of a choice, then EOS once it is one."""
    pieces = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
    tokens, text = [], ""
    while text not in choices:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
        allowed = [t for t, piece in enumerate(pieces) if t not in tokenizer.all_special_ids
                   and any(c.startswith(text + piece) for c in choices)]
        tokens.append(max(allowed, key=lambda t: logits[t]))
        text += pieces[tokens[-1]]
    return tokens + [tokenizer.eos_token_id]


# ---------------------------------------------------------------------------------------------
# 16-bit models and caches, each with a max_model_len of another KV page size and a prompt
# filling most of it.

# (dtype, its checkpoint's fixture, max_model_len, the page size vLLM takes for it, the length
# of a prompt filling most of it, that prompt's seed, the head size row, the context row)
SIXTEEN_BIT = [
    ("bfloat16", "bfloat16_checkpoint", 512, 32, 400, 10, "128", "257-512 (32)"),
    ("float16", "float16_checkpoint", 1024, 64, 900, 11,
     "32 (vLLM's Pallas backend pads it to 128)", "513-1024 (64)"),
]


@pytest.fixture(scope="class", params=SIXTEEN_BIT, ids=[row[0] for row in SIXTEEN_BIT])
def sixteen_bit(request, installed, tmp_path_factory):
    """(the row of SIXTEEN_BIT, its model, an LLM on its checkpoint)."""
    dtype, checkpoint, max_model_len = request.param[:3]
    directory, model = request.getfixturevalue(checkpoint)
    llm = _llm(installed, tmp_path_factory, f"{dtype}_llm", model=directory,
               skip_tokenizer_init=True, max_model_len=max_model_len)
    yield request.param, model, llm
    llm.close()


class TestSixteenBit:

    def test_greedy_tokens_are_transformers_in_the_same_dtype(self, sixteen_bit):
        (dtype, _, max_model_len, page_size, prompt_len, seed, head_size, context), model, llm = \
            sixteen_bit
        assert llm.page_size == page_size
        prompts = PROMPTS[:3] + _prompts([prompt_len], seed=seed)
        for prompt, tokens in zip(prompts, _greedy(llm, prompts)):
            _assert_transformers_greedy(model, prompt, tokens)
        checked = f"greedy tokens equal transformers' {dtype} ones"
        record("dtype", dtype, SUPPORTED, checked)
        record("head size", head_size, SUPPORTED, checked)
        record(CONTEXT, context, SUPPORTED, f"max_model_len {max_model_len} (page size "
               f"{page_size}), a {prompt_len}-token prompt: " + checked)


@pytest.fixture(scope="class")
def float8_cache_llm(installed, bfloat16_checkpoint, tmp_path_factory):
    llm = _llm(installed, tmp_path_factory, "float8_cache_llm", model=bfloat16_checkpoint[0],
               skip_tokenizer_init=True, max_model_len=4096, kv_cache_dtype="fp8_e4m3")
    yield llm
    llm.close()


class TestFloat8Cache:

    def test_greedy_tokens_are_near_transformers_best(self, float8_cache_llm,
                                                      bfloat16_checkpoint):
        """The cache's quantisation moves the logits by ~0.02, so a near-tie may go either
        way: each token is within 0.05 of transformers' best logit (float32 arithmetic on the
        bfloat16 weights), given vLLM's tokens before it."""
        _, model = bfloat16_checkpoint
        model = copy.deepcopy(model).float()
        assert float8_cache_llm.page_size == 128
        prompts = PROMPTS[:3] + _prompts([600], seed=12)
        outputs = _outputs(float8_cache_llm.generate(prompts, temperature=0,
                                                     max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     logprobs=1))
        for prompt, output in zip(prompts, outputs):
            logits = _logits_along(model, prompt, output["tokens"])
            best = logits.max(-1).values
            taken = logits[torch.arange(len(logits)), output["tokens"]]
            assert (best - taken).max() < 0.05, (prompt, output["tokens"], best - taken)
            _assert_logprobs(logits, output["logprobs"], 0.05)  # ~0.02 seen
        record("kv_cache_dtype", "fp8_e4m3, bfloat16 model", SUPPORTED, "greedy tokens each "
               "within a logit of 0.05 of transformers' best, logprobs within 0.05")
        record(CONTEXT, "2049-8192 (128: the Pallas backend's 256, which our kernels do not "
               "take)", SUPPORTED, "max_model_len 4096 (page size 128), a 600-token prompt, "
               "with the float8 cache")


# ---------------------------------------------------------------------------------------------
# Refused when the engine is configured: `LLM(...)` raises, naming the feature.

_CONFIGURE = textwrap.dedent("""
    import json, sys
    from vllm import LLM
    for case, engine_args in json.loads(sys.argv[1]).items():
        try:
            LLM(skip_tokenizer_init=True, max_model_len=128, **engine_args)
            print("STARTED", json.dumps(case), flush=True)
        except ValueError as error:
            print("REFUSED", json.dumps([case, str(error)]), flush=True)
""")


@pytest.fixture(scope="module")
def refused_at_start(installed, float32_checkpoint, bfloat16_checkpoint, tmp_path_factory):
    """case -> the ValueError's message, for the engine configurations of
    test_refused_when_the_engine_is_configured, all tried in one process."""
    import transformers

    tmp = tmp_path_factory.mktemp("refused")
    _checkpoint(tmp / "head_size_320", torch.float32, seed=0, head_dim=320)
    mrope = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=1, embed_dim=64, hidden_size=256, num_heads=2))
    transformers.Qwen2VLForConditionalGeneration(mrope).save_pretrained(tmp / "qwen2_vl")
    float32, bfloat16 = float32_checkpoint[0], bfloat16_checkpoint[0]
    cases = {
        "pooling": dict(model=float32, runner="pooling"),
        "speculative": dict(model=float32, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}),
        "mrope": dict(model=str(tmp / "qwen2_vl")),
        "lora": dict(model=float32, enable_lora=True),
        "fp8_float32": dict(model=float32, dtype="float32", kv_cache_dtype="fp8_e4m3"),
        "fp8_e5m2": dict(model=bfloat16, kv_cache_dtype="fp8_e5m2"),
        "head_size": dict(model=str(tmp / "head_size_320"), dtype="float32"),
    }
    result = subprocess.run([installed[0], "-c", _CONFIGURE, json.dumps(cases)], cwd=tmp,
                            capture_output=True, text=True, timeout=600, env=vllm_env(tmp))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "STARTED" not in result.stdout, result.stdout[-2000:]
    return dict(json.loads(line[len("REFUSED "):]) for line in result.stdout.splitlines()
                if line.startswith("REFUSED "))


@pytest.mark.parametrize("case, row, named", [
    ("pooling", ("Pooling models", "runner pooling"), "pooling models (runner 'pooling')"),
    ("speculative", ("Speculative decoding", "speculative_config"),
     "speculative decoding (speculative_config with method 'ngram')"),
    ("mrope", ("M-RoPE models", "Qwen2-VL"), "M-RoPE models"),
    ("lora", ("LoRA", "enable_lora"), "LoRA (enable_lora)"),
    ("fp8_float32", ("kv_cache_dtype", "fp8_e4m3, float32 model"),
     "kv_cache_dtype 'fp8_e4m3'. Supported: kv_cache_dtype 'auto' for a float32 model"),
    ("fp8_e5m2", ("kv_cache_dtype", "fp8_e5m2"), "kv_cache_dtype 'fp8_e5m2'. Supported: "
     "kv_cache_dtype 'auto' or 'bfloat16' or 'fp8' or 'fp8_e4m3' for a bfloat16 model"),
    ("head_size", ("head size", "320"), "head size 320"),
])
def test_refused_when_the_engine_is_configured(refused_at_start, case, row, named):
    # Our message, without pydantic's wrapping of an error in VllmConfig's checks.
    message = re.search(r"Not supported on the XLA platform: .*?(?= \[type=|$)",
                        refused_at_start[case], re.M)
    assert message and named in message.group(0), refused_at_start[case]
    record(*row, REFUSED, f"when the engine is configured: {message.group(0)}")


# ---------------------------------------------------------------------------------------------

def render():
    lines = [
        "# vLLM on XLA through torch_xla_ext: what is supported",
        "",
        "vLLM 0.13 on XLA through torch_xla_ext's platform plugin (torch_xla_ext/vllm_platform), "
        "as tests/vllm_platform/support_matrix_test.py found it on XLA's CPU, which writes this "
        "file: `UPDATE_VLLM_SUPPORT=1 bazel run //tests/vllm_platform:support_matrix_test`. "
        "Every engine ran with VLLM_XLA_CHECK_RECOMPILATION=1 (no graph compiled after vLLM's "
        "warm-up).",
        "",
        "- supported: a test ran it and checked values against transformers (tokens, sampled "
        "sets, logprobs), as its notes say;",
        "- refused: vLLM raises a ValueError naming it (a 400 from `vllm serve` at the "
        "request), the message in the notes;",
        "- untested: no test here runs it.",
        "",
        "| Feature | Value | Status | Notes |",
        "|---|---|---|---|",
    ]
    for (feature, value), untested_because in ROWS.items():
        status, notes = (UNTESTED, untested_because) if untested_because else _outcomes[
            feature, value]
        lines.append(f"| {feature} | {value} | {status} | {notes.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def test_the_matrix_is_docs_vllm_support_md():
    missing = [row for row, untested_because in ROWS.items()
               if untested_because is None and row not in _outcomes]
    assert not missing, f"no outcome for rows whose tests failed or did not run: {missing}"
    matrix = render()
    if os.environ.get("UPDATE_VLLM_SUPPORT") == "1":
        # The source tree, which `bazel run` names (the runfiles' copy is Bazel's).
        assert "BUILD_WORKSPACE_DIRECTORY" in os.environ, "UPDATE_VLLM_SUPPORT=1 needs bazel run"
        with open(os.path.join(os.environ["BUILD_WORKSPACE_DIRECTORY"], DOC), "w") as doc:
            doc.write(matrix)
        return
    committed = open(DOC).read()
    assert matrix == committed, (
        f"{DOC} is not this run's matrix; regenerate it with `UPDATE_VLLM_SUPPORT=1 bazel run "
        "//tests/vllm_platform:support_matrix_test`:\n" + "".join(difflib.unified_diff(
            committed.splitlines(True), matrix.splitlines(True), DOC, "this run")))
