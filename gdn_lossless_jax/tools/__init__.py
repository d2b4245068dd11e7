"""The tools around the library, apart from its core: the command line (:mod:`~.cli`,
``gdn-lossless``), the bit-exactness report (:mod:`~.check`), the commit fuzzer
(:mod:`~.fuzz`), the memory report (:mod:`~.memory`), the demo (:mod:`~.demo`) and the plots
(:mod:`~.viz`). Each is imported on its own (``from gdn_lossless_jax.tools import memory``)."""
