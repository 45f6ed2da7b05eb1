"""Decontamination: training prompts must not copy or reword a held-out evaluation prompt."""

from headway.train.data.overlap import OverlapIndex, content_words

HELD_OUT = ["How many ways can 5 different books be arranged on a shelf?",
            "What causes the seasons on Earth?",
            "Explain why the sky appears blue during the day and red at sunset."]


def test_a_reworded_held_out_question_is_caught():
    held_out = OverlapIndex(HELD_OUT)
    # the same question with moved words: no 5-gram in common, so only the content words can tell
    assert held_out.overlap("How many different ways can 5 books be arranged on a shelf?")
    assert held_out.overlap("Why is the sky blue during the day but red and orange at sunset?")
    # the held-out question inside a longer one
    assert held_out.overlap("What causes the seasons on Earth? Many think it is the distance from the Sun.")


def test_other_questions_on_a_shared_topic_pass():
    held_out = OverlapIndex(HELD_OUT)
    assert held_out.overlap("How many books can fit on a shelf that is 2 metres long?") is None
    assert held_out.overlap("Why do some planets have seasons and others not?") is None
    assert held_out.overlap("What colour is the sky on Mars at sunset?") is None


def test_rewordings_are_not_near_duplicates_when_the_word_check_is_off():
    """Among training prompts two rewordings of one request are kept: their replies differ."""
    seen = OverlapIndex(HELD_OUT[:1], max_word_jaccard=None)
    assert seen.overlap("How many different ways can 5 books be arranged on a shelf?") is None


def test_content_words_drop_function_words_and_fold_plurals():
    assert content_words("What are the books on the shelves?") == {"book", "shelve"}
    assert content_words("Is this glass of water less than full?") == {"glass", "water", "less", "full"}
