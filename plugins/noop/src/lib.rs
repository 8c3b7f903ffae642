//! The noop executor: confirms every op at once (benchmarks, tests). Its
//! lanes are the op's outbox.

use laneway_sdk::{Executor, Op, OpInput, Outcome};

struct Noop;

const VERSION: &str = "1";

impl Executor for Noop {
    fn describe() -> laneway_sdk::Description {
        laneway_sdk::describe("noop", VERSION, &["noop"])
    }

    fn lanes(input: OpInput) -> Result<Vec<String>, String> {
        Ok(vec![input.outbox])
    }

    fn execute(_op: Op) -> Outcome {
        laneway_sdk::confirmed(&format!("noop v{VERSION}"))
    }
}

laneway_sdk::executor!(Noop);
