//! Host bindings for `laneway:plugin@1.4.0`, generated from `wit/`; 1.0.0
//! to 1.3.0 components resolve against them semver-compatibly.
//!
//! One module per world; they share the `types` interface through `with`.
//! Every host import is async (HTTP and checkpoints do I/O) and trappable
//! (a host failure that is not the guest's business traps the call).

/// The `executor-plugin` world.
pub mod executor {
    wasmtime::component::bindgen!({
        world: "executor-plugin",
        path: "../wit/laneway-plugin@1.4.0",
        imports: { default: async | trappable },
        exports: { default: async },
    });
}

/// The `fee-policy-plugin` world.
pub mod fee_policy {
    wasmtime::component::bindgen!({
        world: "fee-policy-plugin",
        path: "../wit/laneway-plugin@1.4.0",
        imports: { default: async | trappable },
        exports: { default: async },
        with: {
            "laneway:plugin/types": super::executor::laneway::plugin::types,
            "laneway:plugin/log": super::executor::laneway::plugin::log,
        },
    });
}

/// The `validating-executor-plugin` world: only its `validation` export is
/// used from these bindings, for components that have it (the executor
/// itself is called through [`executor`]).
pub mod validating {
    wasmtime::component::bindgen!({
        world: "validating-executor-plugin",
        path: "../wit/laneway-plugin@1.4.0",
        imports: { default: async | trappable },
        exports: { default: async },
        with: {
            "laneway:plugin/types": super::executor::laneway::plugin::types,
            "laneway:plugin/log": super::executor::laneway::plugin::log,
            "laneway:plugin/http": super::executor::laneway::plugin::http,
            "laneway:plugin/signer": super::executor::laneway::plugin::signer,
            "laneway:plugin/checkpoint": super::executor::laneway::plugin::checkpoint,
            "laneway:plugin/fees": super::executor::laneway::plugin::fees,
            "laneway:plugin/notes": super::executor::laneway::plugin::notes,
            "laneway:plugin/mac": super::executor::laneway::plugin::mac,
        },
    });
}
