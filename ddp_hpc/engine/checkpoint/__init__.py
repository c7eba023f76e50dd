"""Checkpoints, one part of the engine: ``checkpointer.py`` (``Checkpointer``: the cadence,
``keep_last``, restore of the newest readable), ``formats.py`` (the file and dcp formats under it), ``files.py`` (one file per checkpoint, or a
rank's part: atomic writes, loading with ``weights_only``), ``dcp_format.py`` (the sharded
format through ``torch.distributed.checkpoint``), ``dcp_read.py`` (reading its folders by one
process: completeness, the newest, weights-only reads), ``background_writer.py`` (a save written
while training goes on), ``host_copy.py`` (the copy to host memory a background save and a
snapshot start with). Beside it in ``engine/``: ``checkpoint_tools.py`` (``inspect_checkpoints``,
``convert_checkpoint``: they read the recovery records too) and ``reshard.py`` (a resume on
another world size: the data order the sampler deals and the learning rate).
"""
