"""Stop strings on hand-made text pieces: held back only while they could still start a stop."""

from edgeinfer.sdk.stopping import StopStrings


def feed(stops, pieces):
    matcher, shown = StopStrings(tuple(stops)), []
    for piece in pieces:
        text, stopped = matcher.add(piece)
        shown.append(text)
        if stopped:
            return shown, True
    return shown + [matcher.flush()], False


def test_a_stop_string_across_pieces_is_cut_with_everything_after_it():
    assert feed(["</s>"], ["Hello <", "/", "s> and more"]) == (["Hello ", "", ""], True)


def test_text_that_could_start_a_stop_is_held_then_released():
    assert feed(["STOP"], ["a S", "T", "x", "yz"]) == (["a ", "", "STx", "yz", ""], False)


def test_held_text_comes_out_at_the_end():
    assert feed(["STOP"], ["end ST"]) == (["end ", "ST"], False)


def test_the_earliest_of_several_stops_wins():
    assert feed(["world", "lo w"], ["hello world"]) == (["hel"], True)


def test_no_stops_holds_nothing():
    assert feed([], ["a", "b"]) == (["a", "b", ""], False)


def test_multibyte_characters():
    assert feed(["🙂!"], ["東京", "🙂", "?🙂", "!x"]) == (["東京", "", "🙂?", ""], True)
