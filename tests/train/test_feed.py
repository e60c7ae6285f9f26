"""CacheFeed: a step's cached tensors, read one step ahead, are the tensors the cache holds."""
import torch

from squareq.train.cache import EmbeddingCache
from squareq.train.feed import CacheFeed


def _cache(tmp_path):
    cache = EmbeddingCache(tmp_path)
    g = torch.Generator().manual_seed(0)
    images, texts = [], {}
    for i in range(4):
        cache.store("latents", f"img{i}", {"latents": torch.randn(4, 8, 8, generator=g)})
        images.append(f"img{i}")
    for caption in ("a", "b", "c", "d", ""):
        texts[caption] = f"txt-{caption}"
        cache.store("text", texts[caption], {"prompt_embeds": torch.randn(6, 5, generator=g),
                                             "pooled_prompt_embeds": torch.randn(3, generator=g)})
    return cache, images, texts


def test_prefetched_batches_equal_direct_reads_and_unused_reads_are_dropped(tmp_path):
    cache, images, texts = _cache(tmp_path)
    captions = ["a", "b", "c", "d"]
    feed = CacheFeed(cache, images, texts, captions, "", torch.device("cpu"))
    try:
        assert feed.latent_shape(2) == torch.Size([4, 8, 8])
        for indices, drops, upcoming in (([2, 0], [False, True], [1, 3]), ([1, 3], [True, False], [0, 2]),
                                         ([0, 2], [False, False], [3, 1])):
            latents, text = feed.batch(indices, drops)
            prompt, pooled = text["prompt_embeds"], text["pooled_prompt_embeds"]
            feed.prefetch(upcoming)
            assert len(feed._pending) == 2 * len(upcoming)  # only the next batch's reads are held
            assert torch.equal(latents, torch.stack([cache.load("latents", images[i])["latents"] for i in indices]))
            want = [cache.load("text", texts["" if d else captions[i]]) for i, d in zip(indices, drops)]
            assert torch.equal(prompt, torch.stack([w["prompt_embeds"] for w in want]))
            assert torch.equal(pooled, torch.stack([w["pooled_prompt_embeds"] for w in want]))
    finally:
        feed.close()


def test_captions_of_different_lengths_are_zero_padded_with_their_masks(tmp_path):
    cache = EmbeddingCache(tmp_path)
    cache.store("latents", "img", {"latents": torch.ones(4, 2, 2)})
    for name, n in (("short", 2), ("long", 5)):
        cache.store("text", name, {"prompt_embeds": torch.full((n, 3), float(n)), "prompt_mask": torch.ones(n)})
    feed = CacheFeed(cache, ["img", "img"], {"s": "short", "l": "long"}, ["s", "l"], "s", torch.device("cpu"))
    try:
        _, text = feed.batch([0, 1], [False, False])
    finally:
        feed.close()
    assert text["prompt_embeds"].shape == (2, 5, 3) and text["prompt_mask"].tolist() == [[1, 1, 0, 0, 0], [1] * 5]
    assert text["prompt_embeds"][0, 2:].abs().sum() == 0 and torch.equal(text["prompt_embeds"][1], torch.full((5, 3), 5.0))


def test_entries_that_do_not_fit_together_are_one_sentence_naming_the_cache(tmp_path):
    """Each entry fits its kind, but not the others of its batch (another run's, or resealed): a sentence, not a
    KeyError or a stacking error from deep in torch."""
    import pytest

    from squareq.train.cache import CacheError

    cache, images, texts = _cache(tmp_path)
    feed = CacheFeed(cache, images, texts, ["a", "b", "c", "d"], "", torch.device("cpu"))
    try:
        feed.batch([0, 1], [False, False])  # positive control: these fit
        cache.store("text", texts["b"], {"prompt_embeds": torch.randn(6, 5)})  # no pooled_prompt_embeds
        with pytest.raises(CacheError, match=r"the text entries of one batch in .* do not fit together \(one holds "
                                             r"pooled_prompt_embeds, prompt_embeds and another prompt_embeds\)"):
            feed.batch([0, 1], [False, False])
        cache.store("latents", images[3], {"latents": torch.randn(4, 8, 16)})
        with pytest.raises(CacheError, match=r"their latents differ in shape: \(4, 8, 8\) and \(4, 8, 16\)"):
            feed.batch([2, 3], [False, False])
    finally:
        feed.close()
