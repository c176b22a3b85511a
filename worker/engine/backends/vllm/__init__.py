"""vLLM V1 as tokenmill's second engine: ``engine.VllmEngine`` drives vLLM's ``LLMEngine`` step by step in
this process (no HTTP server), behind the same interface as tokenmill's own engine.

- settings.py: EngineConfig -> vLLM's engine arguments, and what the backend refuses to start with
  (torch- and vLLM-free: EngineConfig checks it);
- requests.py: an EngineRequest -> vLLM's prompt and SamplingParams, or the fields it cannot honour;
- outputs.py: vLLM's RequestOutputs -> RequestDeltas;
- watchdog.py: every step on a watched thread, so a dead or stuck core ends the process;
- engine.py: the adapter itself.

docs/vllm.md: set-up (``make vllm-env``), the settings, and the field mapping table.
"""
