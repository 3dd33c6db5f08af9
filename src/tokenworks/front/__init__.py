"""The fronts: what the API process, the offline LLM over a front and the benchmarks hold
of an engine, wherever its core runs. interface.py says what every front offers
(EngineFront, and the one Submission it takes); core_client.py talks to one engine core
(a process, a Ray actor or a thread), replicas.py routes over several, disaggregated.py
over prefill and decode engines, hf_front.py runs transformers' own generate. The engine
never imports a front."""
