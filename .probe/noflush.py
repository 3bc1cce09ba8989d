# timing probe only: the deferring burst skips its flush (draft context wrong, outputs still lossless at width 1)
import os, runpy
os.environ["DFLASH_STORED_PROGRAMS"] = "0"
import dflash_jax.serve.runner as R
if os.environ.get("NOFLUSH") == "1":
    R.flush_context = lambda draft_w, state, spec, width=None, rows=None: state.replace(
        context=state.context[:, :width], num_context=state.num_context * 0)
runpy.run_path(".probe/hold1.py", run_name="__main__")
