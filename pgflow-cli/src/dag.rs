//! The DAG of a run drawn as text: one row per level (the longest path from a root), each step as
//! `[slug: state]`, and under each level the edges into the next level's steps (`split ──▶ each`), from
//! whichever level their source is on.

use std::collections::HashMap;

/// A step to draw.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// The step slug.
    pub(crate) slug: String,
    /// The steps it depends on.
    pub(crate) deps: Vec<String>,
    /// Its state in the run (`completed`, `started 3/5`, ...).
    pub(crate) label: String,
}

/// The level of each step: 0 for a root, else one more than its deepest dependency. Dependencies on steps
/// not in `nodes` (never the case for a compiled flow) count as roots.
fn levels(nodes: &[Node]) -> Vec<usize> {
    let index: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.slug.as_str(), i))
        .collect();
    let mut level: Vec<Option<usize>> = vec![None; nodes.len()];
    // A compiled flow is acyclic; the bound on passes keeps a malformed input from looping.
    for _ in 0..=nodes.len() {
        let mut changed = false;
        for (i, n) in nodes.iter().enumerate() {
            if level[i].is_some() {
                continue;
            }
            let mut deepest = Some(0usize);
            let mut has_dep = false;
            for d in &n.deps {
                if let Some(&j) = index.get(d.as_str()) {
                    has_dep = true;
                    deepest = match (deepest, level[j]) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                }
            }
            if let Some(deepest) = deepest {
                level[i] = Some(if has_dep { deepest + 1 } else { 0 });
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    level.into_iter().map(|l| l.unwrap_or(0)).collect()
}

/// Draws `nodes` (in definition order) as lines of text.
pub(crate) fn draw(nodes: &[Node]) -> Vec<String> {
    let level = levels(nodes);
    let depth = level.iter().copied().max().map_or(0, |d| d + 1);
    let mut lines = Vec::new();
    for l in 0..depth {
        let row: Vec<String> = nodes
            .iter()
            .zip(&level)
            .filter(|(_, &nl)| nl == l)
            .map(|(n, _)| format!("[{}: {}]", n.slug, n.label))
            .collect();
        lines.push(row.join("  "));
        let edges: Vec<String> = nodes
            .iter()
            .zip(&level)
            .filter(|(_, &nl)| nl == l + 1)
            .flat_map(|(n, _)| n.deps.iter().map(move |d| format!("{d} ──▶ {}", n.slug)))
            .collect();
        if !edges.is_empty() {
            lines.push(format!("   {}", edges.join("   ")));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(slug: &str, deps: &[&str], label: &str) -> Node {
        Node {
            slug: slug.to_owned(),
            deps: deps.iter().map(|d| (*d).to_owned()).collect(),
            label: label.to_owned(),
        }
    }

    #[test]
    fn levels_follow_the_longest_path_and_edges_are_drawn() {
        let nodes = [
            node("split", &[], "completed"),
            node("side", &[], "completed"),
            node("each", &["split"], "started 2/4"),
            node("total", &["each", "side"], "created"),
        ];
        assert_eq!(levels(&nodes), [0, 0, 1, 2]);
        let lines = draw(&nodes);
        assert_eq!(
            lines,
            [
                "[split: completed]  [side: completed]",
                "   split ──▶ each",
                "[each: started 2/4]",
                "   each ──▶ total   side ──▶ total",
                "[total: created]",
            ]
        );
    }

    #[test]
    fn a_single_step_is_one_box() {
        assert_eq!(
            draw(&[node("work", &[], "completed")]),
            ["[work: completed]"]
        );
    }
}
