"""llama-cpp-python decode timing, as a child process of bench/decode.py.

Run by the interpreter that has ``llama_cpp`` (see bench/setup_llamacpp.sh), so kvfuse's venv
needs no llama.cpp. One JSON object a line on stdin, one answer a line on stdout:

    {"cmd": "load", "name": N, "path": P, "threads": T, "n_ctx": C}     -> {"ok": true, "version": ...}
    {"cmd": "decode", "name": N, "ids": [...], "tokens": K}           -> {"tok_s": ..., "ids": [...], ...}

``decode`` evaluates the prompt ids (the caller's tokenizer: the GGUF's own vocabulary), then
``tokens`` greedy steps (argmax of the last logits, fed back with ``eval``), end-of-sequence
ignored; tokens/s counts the steps after the first token, as kvfuse and transformers are counted.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import llama_cpp
    import numpy as np

    models: dict[str, object] = {}
    out = sys.stdout
    sys.stdout = sys.stderr  # llama.cpp's own prints must not corrupt the protocol
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "load":
                models[msg["name"]] = llama_cpp.Llama(
                    model_path=msg["path"],
                    n_ctx=msg["n_ctx"],
                    n_batch=512,
                    n_threads=msg["threads"],
                    n_threads_batch=msg["threads"],
                    verbose=False,
                )
                reply = {
                    "ok": True,
                    "version": llama_cpp.__version__,
                    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
                }
            elif msg["cmd"] == "decode":
                llm = models[msg["name"]]
                n_vocab = llm.n_vocab()

                def last_logits():  # the batch's one row of logits (logits_all is off), zero-copy
                    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

                llm.reset()
                t0 = time.perf_counter()
                llm.eval(msg["ids"])
                ids = [int(np.argmax(last_logits()))]
                t1 = time.perf_counter()
                for _ in range(msg["tokens"] - 1):
                    llm.eval([ids[-1]])
                    ids.append(int(np.argmax(last_logits())))
                t2 = time.perf_counter()
                reply = {
                    "tok_s": (len(ids) - 1) / (t2 - t1),
                    "prefill_s": t1 - t0,
                    "decode_s": t2 - t1,
                    "ids": ids,
                }
            else:
                reply = {"error": f"unknown command {msg['cmd']!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
