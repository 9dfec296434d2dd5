"""torch's zip checkpoint format (``torch.save``): the container (``container``), its directory
read by miniz's rules (``directory``), its one writer (``writer``), declared sizes against real
bytes (``bounds``), whole pickled modules (``modulepickle``, ``moduletree``), and its torch half
(``torch``: torch's pickling with ckptkit's zip writer)."""
