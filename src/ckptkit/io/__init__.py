"""Files: atomic durable writes of files and folders, bounded reads, the checked copy and CRC-32.

Torch-free, and below ``formats``: it knows bytes and files, no checkpoint format. Modules:
``atomic``/``atomicdir`` (a temp in the same folder, fsync, rename, a check before it),
``fileio`` (``open_regular``, how a checkpoint's files are opened: regular files only, never
blocking on a FIFO; bounded reads, ``copy_range`` with its CRC-32, ``crc32``), ``kcopy`` (the
kernel's copies, ``copy_file_range``, and early writeback), ``helper`` (the kept CRC thread),
``crcmath`` (CRC-32 combination), ``store`` (a path or an object's URL, resolved once),
``remote``/``upload`` (object stores through fsspec), ``lease`` (one writer per
folder: a record taken atomically, renewed while its writer lives).
"""
