//! A run's DAG as SVG: steps in columns by depth, edges from each dependency, coloured by step state.

use std::collections::HashMap;

use maud::{html, Markup};
use pgflow_runtime::admin::StepDetail;

const W: i32 = 170;
const H: i32 = 54;
const GAP_X: i32 = 60;
const GAP_Y: i32 = 22;
const PAD: i32 = 10;

/// The CSS class of a step state (`st-created`, `st-started`, ...).
pub(crate) fn state_class(status: &str) -> String {
    format!("st-{status}")
}

/// The SVG of `steps` (in definition order, so every dependency comes before its dependants).
pub(crate) fn svg(steps: &[StepDetail]) -> Markup {
    let mut depth: HashMap<&str, i32> = HashMap::new();
    let mut row_of_depth: HashMap<i32, i32> = HashMap::new();
    let mut pos: HashMap<&str, (i32, i32)> = HashMap::new();
    for step in steps {
        let d = step
            .deps
            .iter()
            .filter_map(|dep| depth.get(dep.as_str()))
            .map(|d| d + 1)
            .max()
            .unwrap_or(0);
        depth.insert(&step.step_slug, d);
        let row = row_of_depth.entry(d).or_insert(0);
        pos.insert(
            &step.step_slug,
            (PAD + d * (W + GAP_X), PAD + *row * (H + GAP_Y)),
        );
        *row += 1;
    }
    let cols = depth.values().max().map_or(1, |d| d + 1);
    let rows = row_of_depth.values().max().copied().unwrap_or(1);
    let width = 2 * PAD + cols * W + (cols - 1) * GAP_X;
    let height = 2 * PAD + rows * H + (rows - 1).max(0) * GAP_Y;
    html! {
        svg.dag xmlns="http://www.w3.org/2000/svg" width=(width) height=(height)
            viewBox=(format!("0 0 {width} {height}")) role="img" aria-label="The run's steps and their dependencies" {
            defs {
                marker #arrow viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto" {
                    path d="M 0 0 L 10 5 L 0 10 z" fill="#667";
                }
            }
            @for step in steps {
                @for dep in &step.deps {
                    @if let (Some(&(x1, y1)), Some(&(x2, y2))) = (pos.get(dep.as_str()), pos.get(step.step_slug.as_str())) {
                        line.edge x1=(x1 + W) y1=(y1 + H / 2) x2=(x2) y2=(y2 + H / 2) stroke="#667" marker-end="url(#arrow)" {}
                    }
                }
            }
            @for step in steps {
                @let (x, y) = pos[step.step_slug.as_str()];
                g class=(format!("node {}", state_class(step.status.as_str()))) data-step=(step.step_slug) {
                    title { (step.step_slug) ": " (step.status.as_str()) }
                    rect x=(x) y=(y) width=(W) height=(H) rx="6" {}
                    text x=(x + 8) y=(y + 20) class="slug" { (truncate(&step.step_slug, 20)) }
                    text x=(x + 8) y=(y + 40) class="state" {
                        (step.status.as_str())
                        @if let Some((k, n)) = step.progress() {
                            @if step.is_map() || n != 1 { " · " (k) "/" (n) }
                        }
                    }
                }
            }
        }
    }
}

/// `text` cut to `max` characters with an ellipsis.
pub(crate) fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}
