"""Who spoils secure sums, unit by unit: a client is left out only once two invalid sums or more point to it alone."""

from lightning_fl.federated.server.suspects import Suspects


def test_one_invalid_sum_names_its_clients_but_leaves_no_one_out():
    record = Suspects()
    record.record([0, 1, 2], valid=True)
    note = record.record([3], valid=False)  # client 3 alone is in it: a candidate, not yet left out
    assert record.candidates == [3] and record.left_out == set()
    assert note.startswith("candidates (in every invalid secure sum so far, a hostile client among them): [3]")


def test_a_second_invalid_sum_pointing_to_the_same_client_alone_leaves_it_out():
    record = Suspects()
    record.record([2, 3], valid=False)
    note = record.record([1, 3], valid=False)
    assert record.left_out == {3}
    assert note == ("client 3 alone was in all 2 invalid secure sums: it is left out of the secure rounds that follow")


def test_with_no_client_in_every_invalid_sum_no_one_is_left_out():
    record = Suspects()
    record.record([0, 1], valid=False)
    note = record.record([2, 3], valid=False)
    assert note.startswith("no client was in every invalid secure sum") and record.left_out == set()
