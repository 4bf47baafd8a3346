"""The sample after training is printed as text a person reads (train/run.py
readable_sample): a young byte-level model's bytes that are not text show as dots."""

from axonn_launch.train.run import UNREADABLE, readable_sample


def test_a_young_models_bytes_print_as_dots_with_a_note():
    shown = readable_sample(list(b"h\x9e\xbepf\x1fia+\x01\x02\x03"), "shakespeare")
    assert "\\x" not in shown and shown.startswith(f"h{UNREADABLE}")
    assert "not readable yet: " in shown.splitlines()[-1]


def test_text_prints_as_it_is():
    assert (
        readable_sample(list(b"To be, or not\n\tto be"), "shakespeare") == "To be, or not\n\tto be"
    )
    assert readable_sample([104, 300, 105], "shakespeare") == "h<id:300>i"
    assert readable_sample([5, 6], "other") == "5 6"
