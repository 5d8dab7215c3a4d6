"""Draft trees: EAGLE-2 selection in static shapes, and committing an accepted path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import trees
from specjax.drafters import tree_search
from specjax.models.contract import StepInputs
from test_model_contract import jitted_forward, random_llama, random_tree
from conftest import TINY, make_cache


def kv_at(cache, layer, row, positions):
  """Keys and values of `row` at `positions` of one layer: [K, n, H] each."""
  pages = np.asarray(cache.block_tables)[row, np.asarray(positions) // cache.page_size]
  slots = np.asarray(positions) % cache.page_size
  return np.asarray(cache.k_pages[layer])[:, pages, slots], np.asarray(cache.v_pages[layer])[:, pages, slots]


@pytest.fixture(scope='module', params=['gemma3', 'llama-window'])
def module(request):
  if request.param == 'gemma3':
    return specjax.load(TINY).module()
  return random_llama(window=6)


class Shapes:

  def __init__(self, module):
    layout = module.cache_layout()
    self.kv_shapes, self.state_shapes = list(layout.kv_shapes), list(layout.state_shapes)


def test_commit_path_equals_a_fresh_prefill_of_the_accepted_text(module):
  """A tree step, then `commit_path` of one root-to-node path: the cache equals prefilling that text."""
  forward = jitted_forward(module)
  rng = np.random.default_rng(1)
  vocab = 97  # inside both modules' vocabularies
  prompt_lens = np.array([5, 11])  # ragged; the second crosses the window of 6 and several pages
  n = 9
  b, cap = 2, 32
  prompts = rng.integers(1, vocab, (b, prompt_lens.max())).astype(np.int32)
  cache = make_cache(Shapes(module), b, cap, page_size=4, shuffle_pages=True)
  fresh = jax.tree.map(lambda x: x, cache)
  _, cache, _ = forward(
      jnp.asarray(prompts), StepInputs.chain(cache, jnp.asarray(prompt_lens), prompts.shape[1]), cache
  )

  parents_list, depths, mask = random_tree(rng, n)  # node 0: the root (each row's next token)
  parents = np.array([0] + parents_list[1:], np.int32)
  tokens = rng.integers(1, vocab, (b, n)).astype(np.int32)
  inputs = StepInputs.tree(
      cache, jnp.asarray(np.tile(depths, (b, 1))), jnp.asarray(np.tile(mask, (b, 1, 1))), jnp.full((b,), n)
  )
  _, cache, _ = forward(jnp.asarray(tokens), inputs, cache)
  leaf = [int(np.argmax(depths)), n - 1]  # a deepest node for row 0, the last node for row 1
  paths = []
  for row in range(b):
    node, nodes = leaf[row], []
    while True:
      nodes.append(node)
      if node == 0:
        break
      node = int(parents[node])
    paths.append(nodes[::-1])
  width = max(len(p) for p in paths) + 1
  path = np.zeros((b, width), np.int32)
  for row, p in enumerate(paths):
    path[row, : len(p)] = p
  count = np.array([len(p) for p in paths], np.int32)
  committed = cache.commit_path(jnp.asarray(prompt_lens), jnp.asarray(path), jnp.asarray(count))
  np.testing.assert_array_equal(np.asarray(committed.lengths), prompt_lens + count)

  text = np.zeros((b, prompts.shape[1] + width), np.int32)
  for row in range(b):
    seq = list(prompts[row, : prompt_lens[row]]) + [int(tokens[row, i]) for i in paths[row]]
    text[row, : len(seq)] = seq
  _, fresh, _ = forward(
      jnp.asarray(text), StepInputs.chain(fresh, jnp.asarray(prompt_lens + count), text.shape[1]), fresh
  )
  for layer in range(len(committed.k_pages)):
    for row in range(b):
      positions = np.arange(prompt_lens[row] + count[row])
      for got, want in zip(kv_at(committed, layer, row, positions), kv_at(fresh, layer, row, positions)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def level(ids, score, parent):
  return tree_search.Level(jnp.asarray([ids], jnp.int32), jnp.asarray([score], jnp.float32), jnp.asarray([parent]))


def test_select_keeps_the_best_nodes_with_their_ancestry_in_bfs_order():
  # Level 1: the root's children; level 2: children of level-1 nodes [1, 0] (the frontier, best first).
  lv1 = level([10, 11], [-1.0, -0.5], [0, 0])
  lv2 = level([20, 21, 22, 23], [-0.5, -3.0, -1.0, -1.2], [1, 1, 0, 0])
  tree = tree_search.select([lv1, lv2], 4)
  # Best four: 11 (-0.5), 20 (-0.5, child of 11: ties keep the parent first), 10 (-1.0), 22 (-1.0).
  np.testing.assert_array_equal(np.asarray(tree.ids)[0], [10, 11, 20, 22])
  np.testing.assert_array_equal(np.asarray(tree.parents)[0], [0, 0, 2, 1])
  assert int(tree.num_nodes[0]) == 4
  parents = np.concatenate([[0], np.asarray(tree.parents)[0]])[None]
  assert np.all(np.asarray(trees.node_depths(jnp.asarray(parents)))[0] == [0, 1, 1, 2, 2])


def test_select_puts_improbable_candidates_last():
  lv1 = level([10, 11, 12], [-1.0, -np.inf, -2.0], [0, 0, 0])
  tree = tree_search.select([lv1], 3)
  assert int(tree.num_nodes[0]) == 2
  np.testing.assert_array_equal(np.asarray(tree.ids)[0, :2], [10, 12])
  np.testing.assert_array_equal(np.asarray(tree.parents)[0], [0, 0, 0])


def test_node_distributions_remove_earlier_siblings():
  root_q = jnp.asarray([[[0.1, 0.2, 0.3, 0.4]]])  # [B, 1, V]
  lv1 = level([3, 2], [np.log(0.4), np.log(0.3)], [0, 0])
  tree = tree_search.select([lv1], 2)
  q = np.asarray(tree_search.node_distributions(tree, [lv1], [root_q], 2))[0]
  np.testing.assert_allclose(q[0], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
  np.testing.assert_allclose(q[1], np.array([0.1, 0.2, 0.3, 0.0]) / 0.6, rtol=1e-6)


def test_static_shape_lays_a_parent_list_out_as_levels():
  # root -> 1, 2; 1 -> 3, 4; 2 -> 5; 3 -> 6
  shape = tree_search.StaticShape.build(np.array([0, 0, 1, 1, 2, 3]), depth=3)
  assert shape.children == 2
  np.testing.assert_array_equal(shape.frontiers[0], [0, 1])  # both depth-1 nodes expand
  np.testing.assert_array_equal(shape.frontiers[1], [0])  # node 3 (child 0 of node 1)
  # Level 1: 2 candidates; level 2: 4 (children of 1 and 2); level 3: 2 (children of 3).
  np.testing.assert_array_equal(shape.chosen, [0, 1, 2, 3, 4, 6])
  cut = tree_search.StaticShape.build(np.array([0, 0, 1, 1, 2, 3]), depth=1)
  assert cut.frontiers == () and list(cut.chosen) == [0, 1]
