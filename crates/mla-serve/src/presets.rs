//! Model configs bundled from `configs/` (see build.rs): `--model deepseek-v2-lite` etc.

include!(concat!(env!("OUT_DIR"), "/presets.rs"));

pub fn find(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
}

pub fn names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_preset_parses() {
        assert!(super::find("deepseek-v2-lite").is_some());
        for (name, text) in super::PRESETS {
            mla_core::ModelConfig::from_json_str(text, name).unwrap();
        }
    }
}
