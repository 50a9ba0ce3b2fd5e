"""The decoding loop and what it is made of: the decoder (decoder.py: prefill, draft, verify,
accept, commit), the drafters (drafters.py), the gate (gate.py), the acceptance rules
(acceptance.py), scores and stopping (processors.py, policies.py), the assembly of one call or
engine (session.py), the checks of a call's options and model (checks.py) and its statistics
(stats.py). Builds on model/ and lora/; api.py and engine/ run it."""
